/* LD_PRELOAD shim for `ardit store up` on 127.0.0.1: a bind() to the any-address (0.0.0.0, [::])
 * becomes a bind() to loopback (127.0.0.1, or ::ffff:127.0.0.1 for a dual-stack IPv6 socket).
 *
 * Why: Mooncake 0.3.13's transfer engine binds its TCP data port ([::], dual stack) and its
 * handshake port (0.0.0.0) to the any-address whatever MC_TCP_BIND_ADDRESS says, so a segment
 * holder meant for one host would listen on every interface. Built by servers.py with the
 * system C compiler when the servers bind to 127.0.0.1. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    if (!real_bind) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (addr && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    } else if (addr && addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
            inet_pton(AF_INET6, "::ffff:127.0.0.1", &a.sin6_addr);
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    return real_bind(fd, addr, len);
}
