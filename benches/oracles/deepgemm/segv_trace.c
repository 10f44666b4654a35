// segv_trace.c -- LD_PRELOAD helper: on SIGSEGV/SIGBUS/SIGILL/SIGFPE/SIGABRT print a
// native backtrace (with module-relative offsets usable by addr2line) to stderr and
// to $SEGV_TRACE_FILE (if set), then re-raise with the default action (exit 139/134).
//
// Build:  gcc -shared -fPIC -O1 -g -o segv_trace.so segv_trace.c -ldl
// Use:    LD_PRELOAD=$PWD/segv_trace.so SEGV_TRACE_FILE=/tmp/trace.txt python3 ...
//
// Python's faulthandler (PYTHONFAULTHANDLER=1) chains to this handler: it dumps the
// Python stack first, restores the previous handler (this one) and re-raises.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int g_trace_fd = -1;
static char g_trace_path[4096];

static void put_str(int fd, const char* s) {
    if (fd < 0 || s == NULL) return;
    ssize_t r = write(fd, s, strlen(s));
    (void) r;
}

static void put_both(const char* s) {
    put_str(2, s);
    put_str(g_trace_fd, s);
}

static void put_hex(char* buf, uintptr_t v) {
    static const char digits[] = "0123456789abcdef";
    char tmp[32];
    int n = 0;
    do { tmp[n++] = digits[v & 0xf]; v >>= 4; } while (v && n < 30);
    int i = 0;
    buf[i++] = '0'; buf[i++] = 'x';
    while (n) buf[i++] = tmp[--n];
    buf[i] = 0;
}

static void handler(int sig, siginfo_t* info, void* uctx) {
    (void) uctx;
    char line[1024], hex[40];
    if (g_trace_fd < 0 && g_trace_path[0])
        g_trace_fd = open(g_trace_path, O_WRONLY | O_CREAT | O_APPEND, 0644);   // async-signal-safe
    snprintf(line, sizeof(line), "\n==== segv_trace: caught signal %d (%s), fault addr ", sig, strsignal(sig));
    put_both(line);
    put_hex(hex, (uintptr_t) (info ? info->si_addr : 0));
    put_both(hex);
    put_both(" ====\n");

    void* frames[128];
    int n = backtrace(frames, 128);
    backtrace_symbols_fd(frames, n, 2);
    if (g_trace_fd >= 0) backtrace_symbols_fd(frames, n, g_trace_fd);

    // Module-relative offsets (feed to: addr2line -f -C -e <module> <offset>)
    put_both("==== segv_trace: module offsets (module offset symbol) ====\n");
    for (int i = 0; i < n; ++i) {
        Dl_info di;
        memset(&di, 0, sizeof(di));
        if (dladdr(frames[i], &di) && di.dli_fname) {
            char off[40];
            // subtract 1 so the offset points into the call instruction, not after it
            uintptr_t addr = (uintptr_t) frames[i] - (i > 0 ? 1 : 0);
            put_hex(off, addr - (uintptr_t) di.dli_fbase);
            snprintf(line, sizeof(line), "#%02d %s %s %s\n", i, di.dli_fname, off,
                     di.dli_sname ? di.dli_sname : "?");
        } else {
            put_hex(hex, (uintptr_t) frames[i]);
            snprintf(line, sizeof(line), "#%02d ?? %s\n", i, hex);
        }
        put_both(line);
    }
    put_both("==== segv_trace: end ====\n");
    if (g_trace_fd >= 0) fsync(g_trace_fd);

    // Re-raise with default action
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void segv_trace_init(void) {
    const char* path = getenv("SEGV_TRACE_FILE");
    if (path && *path && strlen(path) < sizeof(g_trace_path))
        strcpy(g_trace_path, path);   // the file is only created when a signal arrives

    // Pre-load libgcc's unwinder so backtrace() does not malloc inside the handler
    void* warm[4];
    backtrace(warm, 4);

    // Alternate stack so a stack overflow can still be reported
    static char altstack[1 << 16];
    stack_t ss;
    memset(&ss, 0, sizeof(ss));
    ss.ss_sp = altstack;
    ss.ss_size = sizeof(altstack);
    sigaltstack(&ss, NULL);

    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER | SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    const int sigs[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
    for (unsigned i = 0; i < sizeof(sigs) / sizeof(sigs[0]); ++i)
        sigaction(sigs[i], &sa, NULL);
}
