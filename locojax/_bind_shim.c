/* An LD_PRELOAD library, never imported: while $LOCOJAX_BIND_ADDRESS names an IP address, a TCP socket
 * bound to the wildcard address (0.0.0.0 or ::) is bound to that address instead; every other bind()
 * is passed on unchanged. Ray 2.60's GCS, raylet and core-worker gRPC servers bind the wildcard
 * address whenever their node's address is not loopback (no setting of that release names a listen
 * address: GrpcServer::Run() chooses between GetLocalhostIP() and GetAllInterfacesIP() only), so a
 * DA run's processes and all they start run with this library preloaded (locojax.bind_address).
 *
 * An IPv4 address on an IPv6 socket becomes ::ffff:a.b.c.d: gRPC's dual-stack wildcard socket then
 * accepts IPv4 connections to that one address only. A socket that cannot take the address (an
 * IPv6-only socket and an IPv4 address, an IPv4 socket and an IPv6 address) fails to bind rather than
 * listening everywhere. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static int is_wildcard(const struct sockaddr *addr, socklen_t len) {
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in))
        return ((const struct sockaddr_in *)addr)->sin_addr.s_addr == htonl(INADDR_ANY);
    if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6))
        return IN6_IS_ADDR_UNSPECIFIED(&((const struct sockaddr_in6 *)addr)->sin6_addr);
    return 0;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    if (!real_bind) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *want = getenv("LOCOJAX_BIND_ADDRESS");
    int type = 0;
    socklen_t type_len = sizeof type;
    if (!want || !*want || !addr || !is_wildcard(addr, len)
        || getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &type_len) != 0 || type != SOCK_STREAM)
        return real_bind(fd, addr, len);
    struct in_addr v4;
    struct in6_addr v6;
    if (addr->sa_family == AF_INET) {
        struct sockaddr_in in = *(const struct sockaddr_in *)addr;
        if (inet_pton(AF_INET, want, &v4) != 1) { errno = EADDRNOTAVAIL; return -1; }
        in.sin_addr = v4;
        return real_bind(fd, (const struct sockaddr *)&in, sizeof in);
    }
    struct sockaddr_in6 in6 = *(const struct sockaddr_in6 *)addr;
    if (inet_pton(AF_INET, want, &v4) == 1) {
        memset(&in6.sin6_addr, 0, sizeof in6.sin6_addr);
        in6.sin6_addr.s6_addr[10] = 0xff;
        in6.sin6_addr.s6_addr[11] = 0xff;
        memcpy(&in6.sin6_addr.s6_addr[12], &v4, sizeof v4);
    } else if (inet_pton(AF_INET6, want, &v6) == 1) {
        in6.sin6_addr = v6;
    } else {
        errno = EADDRNOTAVAIL;
        return -1;
    }
    return real_bind(fd, (const struct sockaddr *)&in6, sizeof in6);
}
