/* The client side of a SOCKS5 CONNECT (RFC 1928), no authentication, on the caller's own
 * socket. Every wait is a poll() bounded by the deadline and every send and receive is
 * MSG_DONTWAIT, so the socket's flags are never touched. The reply is read exactly: bytes the
 * peer sends right after it (a server that speaks first) stay in the socket for the caller.
 */
#include <errno.h>
#include <poll.h>
#include <string.h>
#include <time.h>

#include "netshim.h"

enum {
    SOCKS_VERSION = 5,
    METHOD_NO_AUTH = 0,
    METHOD_NONE_ACCEPTABLE = 0xff,
    CMD_CONNECT = 1,
    ATYP_IPV4 = 1,
    ATYP_DOMAIN = 3,
    ATYP_IPV6 = 4,
};

int64_t netshim_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int netshim_wait(int fd, short events, int64_t deadline_ms)
{
    for (;;) {
        int64_t left = deadline_ms - netshim_now_ms();
        if (left <= 0)
            return 0;
        struct pollfd p = {.fd = fd, .events = events};
        int r = poll(&p, 1, left > 1000000 ? 1000000 : (int)left);
        if (r > 0)
            return 1;
        if (r == 0)
            continue; /* re-check the deadline */
        if (errno != EINTR)
            return -1;
        /* EINTR: signals are handled by their handlers; the handshake goes on (bounded). */
    }
}

int netshim_errno_for_reply(int reply)
{
    switch (reply) {
    case 0x01: return ECONNABORTED; /* general failure: the path gave up, reason unnamed */
    case 0x02: return EACCES;       /* not allowed by ruleset: as a local firewall rule */
    case 0x03: return ENETUNREACH;
    case 0x04: return EHOSTUNREACH;
    case 0x05: return ECONNREFUSED;
    case 0x06: return ETIMEDOUT;    /* TTL expired: the endpoint's dial timed out */
    case 0x08: return EAFNOSUPPORT; /* e.g. an IPv6 peer through an IPv4-only endpoint */
    default: return EPROTO;         /* 0x07 (no CONNECT) or a code RFC 1928 does not define */
    }
}

#define FAIL(err, reply, text) ((struct netshim_outcome){(err), (reply), (text)})

/* Sends all of buf; 0, or an outcome error. */
static struct netshim_outcome send_all(int fd, const unsigned char *buf, size_t len,
                                       int64_t deadline_ms)
{
    size_t done = 0;
    while (done < len) {
        ssize_t n = netshim_real.sendto(fd, buf + done, len - done, MSG_NOSIGNAL | MSG_DONTWAIT,
                                        NULL, 0);
        if (n > 0) {
            done += (size_t)n;
            continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            int w = netshim_wait(fd, POLLOUT, deadline_ms);
            if (w == 0)
                return FAIL(ETIMEDOUT, -1, "the SOCKS endpoint did not take the request in time");
            if (w < 0)
                return FAIL(errno, -1, "waiting to send to the SOCKS endpoint failed");
            continue;
        }
        /* EPIPE, ECONNRESET: the endpoint went away, as if it were down. */
        return FAIL(ECONNREFUSED, -1, "the SOCKS endpoint closed the connection");
    }
    return FAIL(0, -1, "sent");
}

/* Receives exactly len bytes. */
static struct netshim_outcome recv_exact(int fd, unsigned char *buf, size_t len,
                                         int64_t deadline_ms)
{
    size_t done = 0;
    while (done < len) {
        ssize_t n = recv(fd, buf + done, len - done, MSG_DONTWAIT);
        if (n > 0) {
            done += (size_t)n;
            continue;
        }
        if (n == 0)
            return FAIL(ECONNREFUSED, -1, "the SOCKS endpoint closed before it replied");
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
            int w = netshim_wait(fd, POLLIN, deadline_ms);
            if (w == 0)
                return FAIL(ETIMEDOUT, -1, "the SOCKS endpoint did not reply in time");
            if (w < 0)
                return FAIL(errno, -1, "waiting for the SOCKS endpoint failed");
            continue;
        }
        return FAIL(ECONNREFUSED, -1, "the SOCKS endpoint reset the connection");
    }
    return FAIL(0, -1, "received");
}

struct netshim_outcome netshim_socks5_handshake(int fd, const struct netshim_dest *dst,
                                                int64_t deadline_ms)
{
    /* Greeting, then the method reply: RFC 1928 has the client wait for it, and some
     * servers drop a request pipelined behind the greeting. */
    static const unsigned char greeting[3] = {SOCKS_VERSION, 1, METHOD_NO_AUTH};
    struct netshim_outcome o = send_all(fd, greeting, sizeof greeting, deadline_ms);
    if (o.error)
        return o;
    unsigned char method[2];
    o = recv_exact(fd, method, sizeof method, deadline_ms);
    if (o.error)
        return o;
    if (method[0] != SOCKS_VERSION)
        return FAIL(EPROTO, -1, "the endpoint does not speak SOCKS5");
    if (method[1] == METHOD_NONE_ACCEPTABLE)
        return FAIL(EACCES, -1, "the SOCKS endpoint requires authentication");
    if (method[1] != METHOD_NO_AUTH)
        return FAIL(EPROTO, -1, "the SOCKS endpoint chose a method that was not offered");

    unsigned char request[4 + 16 + 2] = {SOCKS_VERSION, CMD_CONNECT, 0};
    size_t len = 4;
    if (dst->family == AF_INET) {
        request[3] = ATYP_IPV4;
        memcpy(request + len, &dst->addr.v4, 4);
        len += 4;
    } else {
        request[3] = ATYP_IPV6;
        memcpy(request + len, &dst->addr.v6, 16);
        len += 16;
    }
    memcpy(request + len, &dst->port, 2);
    len += 2;
    o = send_all(fd, request, len, deadline_ms);
    if (o.error)
        return o;

    /* VER REP RSV ATYP, then BND.ADDR (by ATYP) and BND.PORT. */
    unsigned char head[4];
    o = recv_exact(fd, head, sizeof head, deadline_ms);
    if (o.error)
        return o;
    if (head[0] != SOCKS_VERSION)
        return FAIL(EPROTO, -1, "the SOCKS endpoint replied with another version");
    size_t rest;
    unsigned char scratch[255 + 2];
    if (head[3] == ATYP_IPV4) {
        rest = 4 + 2;
    } else if (head[3] == ATYP_IPV6) {
        rest = 16 + 2;
    } else if (head[3] == ATYP_DOMAIN) {
        unsigned char n;
        o = recv_exact(fd, &n, 1, deadline_ms);
        if (o.error)
            return o;
        rest = (size_t)n + 2;
    } else {
        return FAIL(EPROTO, head[1], "the SOCKS reply has an unknown address type");
    }
    o = recv_exact(fd, scratch, rest, deadline_ms);
    if (o.error)
        return o;
    if (head[1] != 0)
        return FAIL(netshim_errno_for_reply(head[1]), head[1], "the SOCKS endpoint refused");
    return FAIL(0, 0, "connected");
}
