/* The functions libnodus-netshim.so interposes (the only symbols it exports), and its
 * constructor.
 *
 *   connect        TCP to a peer -> through the SOCKS5 endpoint (redirect.c); else untouched
 *   sendto/sendmsg MSG_FASTOPEN to a peer (TCP Fast Open without connect) -> same
 *   getpeername    a redirected socket answers with its peer, not the endpoint
 *   close, dup, dup2, dup3, fcntl(F_DUPFD, F_DUPFD_CLOEXEC)   keep that record right
 *
 * The cost for traffic the shim leaves alone: connect compares the destination with the
 * peer list (no system call); close and the dup family look at one table slot; nothing else
 * (send, recv, poll, ...) is hooked, so an established connection runs at native speed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <string.h>
#include <sys/socket.h>

#include "netshim.h"

#define EXPORT __attribute__((visibility("default")))

static inline void ready(void)
{
    if (__atomic_load_n(&netshim_real.connect, __ATOMIC_ACQUIRE) == NULL)
        netshim_resolve();
}

__attribute__((constructor)) static void netshim_init(void)
{
    int saved = errno;
    netshim_resolve();
    netshim_config_load();
    if (netshim_cfg.active)
        pthread_atfork(NULL, NULL, netshim_fd_after_fork_child);
    if (netshim_cfg.debug) {
        netshim_debug("loaded: %zu peer(s), SOCKS endpoint %s, timeout %d ms%s%s",
                      netshim_cfg.n_peers4 + netshim_cfg.n_peers6,
                      netshim_cfg.socks_ok ? netshim_cfg.socks_text : "(none)",
                      netshim_cfg.timeout_ms, netshim_cfg.error[0] ? "; " : "",
                      netshim_cfg.error);
    }
    netshim_write_marker();
    errno = saved;
}

EXPORT int connect(int fd, const struct sockaddr *addr, socklen_t len)
{
    ready();
    struct netshim_dest dst;
    if (netshim_cfg.active && netshim_peer_match(addr, len, &dst) &&
        netshim_is_tcp(fd, addr->sa_family))
        return netshim_redirect(fd, addr, len, &dst);
    int r = netshim_real.connect(fd, addr, len);
    if (netshim_fd_any()) {
        /* A socket the shim redirected once may be disconnected (AF_UNSPEC) and connected
         * elsewhere directly: forget its peer. Preserves errno. */
        int saved = errno;
        if (r == 0 || errno == EINPROGRESS || (addr != NULL && addr->sa_family == AF_UNSPEC))
            netshim_fd_clear(fd);
        errno = saved;
    }
    return r;
}

/* Is this address the SOCKS endpoint (as an IPv4 socket or an IPv6 socket sees it)? */
static int is_endpoint(const struct sockaddr *sa, socklen_t len)
{
    const struct netshim_dest *ep = &netshim_cfg.socks;
    if (sa->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)sa;
        return ep->family == AF_INET && in->sin_port == ep->port &&
               in->sin_addr.s_addr == ep->addr.v4.s_addr;
    }
    if (sa->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)sa;
        if (in6->sin6_port != ep->port)
            return 0;
        if (ep->family == AF_INET6)
            return memcmp(&in6->sin6_addr, &ep->addr.v6, sizeof ep->addr.v6) == 0;
        return IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr) &&
               memcmp(&in6->sin6_addr.s6_addr[12], &ep->addr.v4, 4) == 0;
    }
    return 0;
}

EXPORT int getpeername(int fd, struct sockaddr *addr, socklen_t *len)
{
    ready();
    socklen_t given = len != NULL ? *len : 0;
    int r = netshim_real.getpeername(fd, addr, len);
    if (r != 0 || !netshim_fd_any() || !netshim_cfg.socks_ok)
        return r;
    int saved = errno;
    /* Only a socket whose kernel peer is the endpoint can be one the shim redirected (the
     * caller may also have disconnected it and connected elsewhere behind the hooks). */
    struct sockaddr_storage kernel;
    socklen_t kernel_len = *len;
    int via_endpoint;
    if (*len <= given) {
        via_endpoint = is_endpoint(addr, *len);
    } else { /* the caller's buffer was too small to hold the whole address: ask again */
        kernel_len = sizeof kernel;
        via_endpoint = netshim_real.getpeername(fd, (struct sockaddr *)&kernel, &kernel_len) == 0 &&
                       is_endpoint((struct sockaddr *)&kernel, kernel_len);
    }
    struct sockaddr_storage peer;
    socklen_t peer_len;
    if (via_endpoint && netshim_fd_lookup(fd, &peer, &peer_len) == 0) {
        memcpy(addr, &peer, peer_len < given ? peer_len : given);
        *len = peer_len;
    }
    errno = saved;
    return 0;
}

/* MSG_FASTOPEN sends the SYN with data and needs no connect(): treat it as a connect to the
 * peer followed by a plain send, so Fast Open callers are redirected too. */
static int fastopen_redirect(int fd, const struct sockaddr *addr, socklen_t len)
{
    struct netshim_dest dst;
    if (!netshim_cfg.active || !netshim_peer_match(addr, len, &dst) ||
        !netshim_is_tcp(fd, addr->sa_family))
        return 0;
    return netshim_redirect(fd, addr, len, &dst) == 0 ? 1 : -1;
}

EXPORT ssize_t sendto(int fd, const void *buf, size_t n, int flags, const struct sockaddr *addr,
                      socklen_t len)
{
    ready();
    if (flags & MSG_FASTOPEN) {
        int redirected = fastopen_redirect(fd, addr, len);
        if (redirected < 0)
            return -1;
        if (redirected)
            return netshim_real.sendto(fd, buf, n, flags & ~MSG_FASTOPEN, NULL, 0);
    }
    return netshim_real.sendto(fd, buf, n, flags, addr, len);
}

EXPORT ssize_t sendmsg(int fd, const struct msghdr *msg, int flags)
{
    ready();
    if ((flags & MSG_FASTOPEN) && msg != NULL) {
        int redirected = fastopen_redirect(fd, msg->msg_name, msg->msg_namelen);
        if (redirected < 0)
            return -1;
        if (redirected) {
            struct msghdr plain = *msg;
            plain.msg_name = NULL;
            plain.msg_namelen = 0;
            return netshim_real.sendmsg(fd, &plain, flags & ~MSG_FASTOPEN);
        }
    }
    return netshim_real.sendmsg(fd, msg, flags);
}

EXPORT int close(int fd)
{
    ready();
    if (netshim_fd_any())
        netshim_fd_clear(fd);
    return netshim_real.close(fd);
}

EXPORT int dup(int fd)
{
    ready();
    int r = netshim_real.dup(fd);
    if (r >= 0 && netshim_fd_any()) {
        int saved = errno;
        netshim_fd_copy(fd, r);
        errno = saved;
    }
    return r;
}

EXPORT int dup2(int fd, int to)
{
    ready();
    int r = netshim_real.dup2(fd, to);
    if (r >= 0 && netshim_fd_any()) {
        int saved = errno;
        netshim_fd_copy(fd, r);
        errno = saved;
    }
    return r;
}

EXPORT int dup3(int fd, int to, int flags)
{
    ready();
    int r = netshim_real.dup3(fd, to, flags);
    if (r >= 0 && netshim_fd_any()) {
        int saved = errno;
        netshim_fd_copy(fd, r);
        errno = saved;
    }
    return r;
}

/* fcntl's third argument is an int, a long or a pointer depending on cmd; like glibc's own
 * fcntl, take it as a pointer-sized value and pass it on unchanged. */
static int fcntl_common(int (*real)(int, int, ...), int fd, int cmd, void *arg)
{
    int r = real(fd, cmd, arg);
    if (r >= 0 && (cmd == F_DUPFD || cmd == F_DUPFD_CLOEXEC) && netshim_fd_any()) {
        int saved = errno;
        netshim_fd_copy(fd, r);
        errno = saved;
    }
    return r;
}

EXPORT int fcntl(int fd, int cmd, ...)
{
    ready();
    va_list ap;
    va_start(ap, cmd);
    void *arg = va_arg(ap, void *);
    va_end(ap);
    return fcntl_common(netshim_real.fcntl, fd, cmd, arg);
}

EXPORT int fcntl64(int fd, int cmd, ...)
{
    ready();
    va_list ap;
    va_start(ap, cmd);
    void *arg = va_arg(ap, void *);
    va_end(ap);
    return fcntl_common(netshim_real.fcntl64, fd, cmd, arg);
}
