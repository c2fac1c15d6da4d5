/* A would-block recv(2) or send(2) waits in poll(2) instead of spinning: the test suite's
 * LD_PRELOAD (tests/conftest.py builds it; tests/fabric.py hands it to the fabric's ssh sessions).
 *
 * Why: MLX's ring backend gives each socket a thread that calls non-blocking recv and send in a
 * loop while a transfer is pending. A rank that reaches an all-reduce first spins a core until the
 * slowest rank gets there. On a Mac each rank has its own machine, so that costs nothing; here two
 * to four ranks and their sshds share 2 cores, and the spinning ranks take the cores the working
 * rank needs (a 2-rank training test ran in 62 s with the spin and 26 s without).
 *
 * What changes: only a call that would block. After 64 of them in a row on one thread (a short
 * wait still spins, so no latency is added there), each one first waits in poll(2) for that socket
 * to become ready, at most 1 ms, then returns -1 with errno EAGAIN as before. Every byte, its
 * order and every other return value are the real call's. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>

static __thread unsigned misses;

static ssize_t settle(ssize_t r, int fd, short events) {
    if (r >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
        misses = 0;
        return r;
    }
    if (++misses >= 64) {
        struct pollfd p = {.fd = fd, .events = events};
        poll(&p, 1, 1);
    }
    errno = EAGAIN;
    return r;
}

ssize_t recv(int fd, void *buf, size_t n, int flags) {
    static ssize_t (*real)(int, void *, size_t, int);
    if (!real)
        real = (ssize_t (*)(int, void *, size_t, int))dlsym(RTLD_NEXT, "recv");
    return settle(real(fd, buf, n, flags), fd, POLLIN);
}

ssize_t send(int fd, const void *buf, size_t n, int flags) {
    static ssize_t (*real)(int, const void *, size_t, int);
    if (!real)
        real = (ssize_t (*)(int, const void *, size_t, int))dlsym(RTLD_NEXT, "send");
    return settle(real(fd, buf, n, flags), fd, POLLOUT);
}
