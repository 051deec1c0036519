/* A connect() to a peer, done through the SOCKS5 endpoint on the caller's own socket.
 *
 * Blocking and non-blocking sockets alike: connect the socket to the endpoint, run the
 * SOCKS5 handshake to the end (bounded: SO_SNDTIMEO on a blocking socket that has one, else
 * NODUS_NETSHIM_TIMEOUT_MS), and return what connect() returns for a connection that is made
 * or refused at once: 0, or -1 with errno. A non-blocking caller thus never sees EINPROGRESS
 * from a redirected connect; its poll() then reports the socket writable at once and
 * getsockopt(SO_ERROR) 0, which is how non-blocking connect + poll/SO_ERROR code (NCCL,
 * Gloo, libcurl, asyncio) already handles an immediate connect. The endpoint is local (the
 * agent), so the wait is the time the agent takes to reach the peer.
 *
 * On failure the socket is disconnected again (connect with AF_UNSPEC), so it is exactly as
 * the caller left it: a retry loop that calls connect() again on the same fd (NCCL does,
 * after ECONNREFUSED) works. Options, binding and flags are never touched.
 */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <string.h>
#include <sys/time.h>

#include "netshim.h"

#ifndef IPPROTO_MPTCP
#define IPPROTO_MPTCP 262
#endif

int netshim_is_tcp(int fd, int family)
{
    int value = 0;
    socklen_t len = sizeof value;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &value, &len) != 0 || value != SOCK_STREAM)
        return 0;
    len = sizeof value;
    if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &value, &len) != 0 || value != family)
        return 0;
    len = sizeof value;
    if (getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &value, &len) != 0)
        return 0;
    return value == IPPROTO_TCP || value == IPPROTO_MPTCP;
}

/* The endpoint as a sockaddr of the socket's family; -1 when it cannot be expressed. */
static int endpoint_for(int family, struct sockaddr_storage *out, socklen_t *len)
{
    const struct netshim_dest *ep = &netshim_cfg.socks;
    memset(out, 0, sizeof *out);
    if (family == AF_INET) {
        if (ep->family != AF_INET)
            return -1;
        struct sockaddr_in *in = (struct sockaddr_in *)out;
        in->sin_family = AF_INET;
        in->sin_addr = ep->addr.v4;
        in->sin_port = ep->port;
        *len = sizeof *in;
        return 0;
    }
    struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)out;
    in6->sin6_family = AF_INET6;
    in6->sin6_port = ep->port;
    if (ep->family == AF_INET6) {
        in6->sin6_addr = ep->addr.v6;
    } else { /* an IPv6 socket reaches an IPv4 endpoint at its IPv4-mapped address */
        in6->sin6_addr.s6_addr[10] = 0xff;
        in6->sin6_addr.s6_addr[11] = 0xff;
        memcpy(&in6->sin6_addr.s6_addr[12], &ep->addr.v4, 4);
    }
    *len = sizeof *in6;
    return 0;
}

static int timeout_ms_for(int fd)
{
    int flags = netshim_real.fcntl(fd, F_GETFL);
    if (flags >= 0 && !(flags & O_NONBLOCK)) {
        struct timeval tv = {0};
        socklen_t len = sizeof tv;
        if (getsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, &len) == 0 &&
            (tv.tv_sec > 0 || tv.tv_usec > 0)) {
            long ms = tv.tv_sec * 1000L + tv.tv_usec / 1000L;
            return ms < 1 ? 1 : (ms > 86400000L ? 86400000 : (int)ms);
        }
    }
    return netshim_cfg.timeout_ms;
}

static void disconnect(int fd)
{
    struct sockaddr unspec;
    memset(&unspec, 0, sizeof unspec);
    unspec.sa_family = AF_UNSPEC;
    netshim_real.connect(fd, &unspec, sizeof unspec);
}

static int fail(int fd, int error, int connected, const char *peer, int reply, const char *what,
                int64_t started)
{
    if (connected)
        disconnect(fd);
    if (reply >= 0)
        netshim_debug("connect fd=%d %s via %s: %s (SOCKS reply %d) -> %s, %lld ms", fd, peer,
                      netshim_cfg.socks_text, what, reply, strerror(error),
                      (long long)(netshim_now_ms() - started));
    else
        netshim_debug("connect fd=%d %s via %s: %s -> %s, %lld ms", fd, peer,
                      netshim_cfg.socks_text, what, strerror(error),
                      (long long)(netshim_now_ms() - started));
    errno = error;
    return -1;
}

int netshim_redirect(int fd, const struct sockaddr *addr, socklen_t len,
                     const struct netshim_dest *dst)
{
    char peer[INET6_ADDRSTRLEN + 16];
    netshim_format_dest(dst, peer, sizeof peer);
    int64_t started = netshim_now_ms();
    if (!netshim_cfg.socks_ok)
        return fail(fd, ENETUNREACH, 0, peer, -1, "no usable NODUS_NETSHIM_SOCKS", started);

    struct sockaddr_storage endpoint;
    socklen_t endpoint_len;
    if (endpoint_for(addr->sa_family, &endpoint, &endpoint_len) != 0)
        return fail(fd, ENETUNREACH, 0, peer, -1,
                    "the SOCKS endpoint is IPv6 and this socket is AF_INET", started);

    int64_t deadline = started + timeout_ms_for(fd);
    if (netshim_real.connect(fd, (struct sockaddr *)&endpoint, endpoint_len) != 0) {
        int error = errno;
        if (error == EISCONN || error == EALREADY) {
            /* Already connected (to the endpoint, by an earlier call) or a connect under way:
             * what the kernel says is what a direct connect would say. */
            errno = error;
            return -1;
        }
        if (error != EINPROGRESS && error != EINTR)
            return fail(fd, error, 0, peer, -1, "cannot connect to the SOCKS endpoint", started);
        int w = netshim_wait(fd, POLLOUT, deadline);
        if (w <= 0)
            return fail(fd, w == 0 ? ETIMEDOUT : errno, 1, peer, -1,
                        "the SOCKS endpoint did not accept in time", started);
        int so_error = 0;
        socklen_t so_len = sizeof so_error;
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &so_len);
        if (so_error != 0)
            return fail(fd, so_error, 0, peer, -1, "cannot connect to the SOCKS endpoint",
                        started);
    }

    struct netshim_outcome o = netshim_socks5_handshake(fd, dst, deadline);
    if (o.error)
        return fail(fd, o.error, 1, peer, o.socks_reply, o.what, started);

    /* Remember the peer as the caller named it, for getpeername. */
    union {
        struct sockaddr_in v4;
        struct sockaddr_in6 v6;
    } named;
    memset(&named, 0, sizeof named);
    socklen_t named_len = addr->sa_family == AF_INET ? sizeof named.v4 : sizeof named.v6;
    memcpy(&named, addr, len < named_len ? len : named_len);
    if (addr->sa_family == AF_INET)
        memset(named.v4.sin_zero, 0, sizeof named.v4.sin_zero);
    netshim_fd_set(fd, netshim_socket_identity(fd), (struct sockaddr *)&named, named_len);
    netshim_debug("connect fd=%d %s via %s: connected, %lld ms", fd, peer,
                  netshim_cfg.socks_text, (long long)(netshim_now_ms() - started));
    return 0;
}
