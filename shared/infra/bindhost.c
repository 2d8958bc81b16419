/*
 * Binds what native libraries bind to "any address" to the host a service was given.
 *
 * Preloaded (LD_PRELOAD) into the processes that run Mooncake and torch.distributed
 * (shared/infra/bindhost.py sets it up): Mooncake's transfer engine opens its handshake
 * and data ports on the wildcard address, its master's HTTP metadata server ignores the
 * host it is told, and torch's TCPStore listens on all interfaces. With PDMESH_BIND_HOST
 * set to an IP address, a bind() to 0.0.0.0 binds that address instead, and a bind() to
 * :: binds it too (as ::ffff:a.b.c.d on a dual-stack socket, ::1 for 127.0.0.1 on an
 * IPv6-only one). Every other bind() - a specific address, a unix socket - passes as it is.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static int real_bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real;
    if (real == NULL)
        real = (bind_fn)dlsym(RTLD_NEXT, "bind");
    return real(fd, addr, len);
}

/* An IPv4 wildcard bind, moved to the host. */
static int bind_v4(int fd, const struct sockaddr_in *in, const char *host) {
    struct sockaddr_in moved = *in;
    if (inet_pton(AF_INET, host, &moved.sin_addr) != 1)
        return real_bind(fd, (const struct sockaddr *)in, sizeof *in);
    return real_bind(fd, (const struct sockaddr *)&moved, sizeof moved);
}

/* An IPv6 wildcard bind, moved to the host (an IPv4 host as its mapped address). */
static int bind_v6(int fd, const struct sockaddr_in6 *in6, const char *host) {
    struct sockaddr_in6 moved = *in6;
    struct in_addr v4;
    int v6only = 0;
    socklen_t n = sizeof v6only;
    if (inet_pton(AF_INET6, host, &moved.sin6_addr) == 1)
        return real_bind(fd, (const struct sockaddr *)&moved, sizeof moved);
    if (inet_pton(AF_INET, host, &v4) != 1)
        return real_bind(fd, (const struct sockaddr *)in6, sizeof *in6);
    getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &n);
    if (v6only) {
        if (ntohl(v4.s_addr) >> 24 != 127)  /* no IPv6 form of this address */
            return real_bind(fd, (const struct sockaddr *)in6, sizeof *in6);
        moved.sin6_addr = in6addr_loopback;
    } else {
        memset(&moved.sin6_addr, 0, sizeof moved.sin6_addr);
        moved.sin6_addr.s6_addr[10] = 0xff;
        moved.sin6_addr.s6_addr[11] = 0xff;
        memcpy(&moved.sin6_addr.s6_addr[12], &v4, sizeof v4);
    }
    return real_bind(fd, (const struct sockaddr *)&moved, sizeof moved);
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    const char *host = getenv("PDMESH_BIND_HOST");
    if (host == NULL || *host == '\0' || addr == NULL)
        return real_bind(fd, addr, len);
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)addr;
        if (in->sin_addr.s_addr == htonl(INADDR_ANY))
            return bind_v4(fd, in, host);
    } else if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)addr;
        if (IN6_IS_ADDR_UNSPECIFIED(&in6->sin6_addr))
            return bind_v6(fd, in6, host);
    }
    return real_bind(fd, addr, len);
}
