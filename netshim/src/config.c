/* The shim's configuration: four environment variables, read once when the library loads.
 *
 *   NODUS_NETSHIM_PEERS       comma-separated IP literals whose TCP connects are redirected
 *   NODUS_NETSHIM_SOCKS       the SOCKS5 endpoint, "127.0.0.1:1080" or "[::1]:1080"
 *   NODUS_NETSHIM_TIMEOUT_MS  bound on one redirected connect (default 30000)
 *   NODUS_NETSHIM_DEBUG       any value but "" or "0": one line per decision on stderr
 *
 * Children inherit the variables with LD_PRELOAD, and their own copy of the library reads
 * them again, so a child sees what its parent was started with.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "netshim.h"

#define DEFAULT_TIMEOUT_MS 30000
#define MAX_PEERS 4096

struct netshim_config netshim_cfg = {.timeout_ms = DEFAULT_TIMEOUT_MS};

static void config_error(const char *fmt, const char *detail)
{
    if (netshim_cfg.error[0] != '\0')
        return; /* keep the first one */
    snprintf(netshim_cfg.error, sizeof netshim_cfg.error, fmt, detail);
}

/* Copies [start, end) into buf without surrounding blanks; 0 on success. */
static int trimmed(const char *start, const char *end, char *buf, size_t size)
{
    while (start < end && (*start == ' ' || *start == '\t'))
        start++;
    while (end > start && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\n'))
        end--;
    size_t n = (size_t)(end - start);
    if (n >= size)
        return -1;
    memcpy(buf, start, n);
    buf[n] = '\0';
    return 0;
}

/* An IP literal, optionally in brackets; IPv4-mapped IPv6 is reduced to IPv4. */
static int parse_ip(const char *text, struct netshim_dest *out)
{
    char buf[INET6_ADDRSTRLEN + 2];
    size_t n = strlen(text);
    if (n >= sizeof buf)
        return -1;
    if (n >= 2 && text[0] == '[' && text[n - 1] == ']') {
        memcpy(buf, text + 1, n - 2);
        buf[n - 2] = '\0';
    } else {
        memcpy(buf, text, n + 1);
    }
    memset(out, 0, sizeof *out);
    if (inet_pton(AF_INET, buf, &out->addr.v4) == 1) {
        out->family = AF_INET;
        return 0;
    }
    if (inet_pton(AF_INET6, buf, &out->addr.v6) == 1) {
        if (IN6_IS_ADDR_V4MAPPED(&out->addr.v6)) {
            struct in_addr v4;
            memcpy(&v4, &out->addr.v6.s6_addr[12], 4);
            out->addr.v4 = v4;
            out->family = AF_INET;
        } else {
            out->family = AF_INET6;
        }
        return 0;
    }
    return -1;
}

static int parse_port(const char *text, in_port_t *port)
{
    if (*text == '\0')
        return -1;
    char *end = NULL;
    errno = 0;
    long value = strtol(text, &end, 10);
    if (errno != 0 || *end != '\0' || value < 1 || value > 65535)
        return -1;
    *port = htons((uint16_t)value);
    return 0;
}

int netshim_parse_endpoint(const char *text, struct netshim_dest *out)
{
    char buf[INET6_ADDRSTRLEN + 16];
    if (trimmed(text, text + strlen(text), buf, sizeof buf) != 0)
        return -1;
    char *colon;
    if (buf[0] == '[') {
        char *close = strchr(buf, ']');
        if (close == NULL || close[1] != ':')
            return -1;
        colon = close + 1;
    } else {
        colon = strrchr(buf, ':');
        if (colon == NULL)
            return -1;
    }
    *colon = '\0';
    if (parse_ip(buf, out) != 0)
        return -1;
    return parse_port(colon + 1, &out->port);
}

static void add_peer(const char *entry, size_t *cap4, size_t *cap6)
{
    struct netshim_dest d;
    if (parse_ip(entry, &d) != 0) {
        config_error("NODUS_NETSHIM_PEERS: '%s' is not an IP literal (ignored)", entry);
        return;
    }
    if (netshim_cfg.n_peers4 + netshim_cfg.n_peers6 >= MAX_PEERS) {
        config_error("NODUS_NETSHIM_PEERS: more than %s peers (the rest ignored)", "4096");
        return;
    }
    if (d.family == AF_INET) {
        if (netshim_cfg.n_peers4 == *cap4) {
            size_t cap = *cap4 ? *cap4 * 2 : 8;
            struct in_addr *grown = realloc(netshim_cfg.peers4, cap * sizeof *grown);
            if (grown == NULL)
                return;
            netshim_cfg.peers4 = grown;
            *cap4 = cap;
        }
        netshim_cfg.peers4[netshim_cfg.n_peers4++] = d.addr.v4;
    } else {
        if (netshim_cfg.n_peers6 == *cap6) {
            size_t cap = *cap6 ? *cap6 * 2 : 8;
            struct in6_addr *grown = realloc(netshim_cfg.peers6, cap * sizeof *grown);
            if (grown == NULL)
                return;
            netshim_cfg.peers6 = grown;
            *cap6 = cap;
        }
        netshim_cfg.peers6[netshim_cfg.n_peers6++] = d.addr.v6;
    }
}

static void load_peers(const char *text)
{
    size_t cap4 = 0, cap6 = 0;
    const char *p = text;
    while (*p != '\0') {
        const char *end = strchr(p, ',');
        if (end == NULL)
            end = p + strlen(p);
        char entry[INET6_ADDRSTRLEN + 8];
        if (trimmed(p, end, entry, sizeof entry) != 0)
            config_error("NODUS_NETSHIM_PEERS: an entry is too long to be an IP literal%s", "");
        else if (entry[0] != '\0')
            add_peer(entry, &cap4, &cap6);
        p = *end ? end + 1 : end;
    }
}

void netshim_config_load(void)
{
    const char *debug = getenv("NODUS_NETSHIM_DEBUG");
    netshim_cfg.debug = debug != NULL && debug[0] != '\0' && strcmp(debug, "0") != 0;

    const char *timeout = getenv("NODUS_NETSHIM_TIMEOUT_MS");
    if (timeout != NULL && timeout[0] != '\0') {
        char *end = NULL;
        errno = 0;
        long value = strtol(timeout, &end, 10);
        if (errno != 0 || *end != '\0' || value < 1 || value > 24L * 3600 * 1000)
            config_error("NODUS_NETSHIM_TIMEOUT_MS: '%s' is not a positive number of ms "
                         "(using 30000)",
                         timeout);
        else
            netshim_cfg.timeout_ms = (int)value;
    }

    const char *peers = getenv("NODUS_NETSHIM_PEERS");
    if (peers != NULL)
        load_peers(peers);
    netshim_cfg.active = netshim_cfg.n_peers4 + netshim_cfg.n_peers6 > 0;

    const char *socks = getenv("NODUS_NETSHIM_SOCKS");
    if (socks != NULL && socks[0] != '\0') {
        snprintf(netshim_cfg.socks_text, sizeof netshim_cfg.socks_text, "%s", socks);
        if (netshim_parse_endpoint(socks, &netshim_cfg.socks) == 0)
            netshim_cfg.socks_ok = 1;
        else
            config_error("NODUS_NETSHIM_SOCKS: '%s' is not HOST:PORT with an IP literal host "
                         "(connects to peers fail with ENETUNREACH)",
                         socks);
    } else if (netshim_cfg.active) {
        config_error("NODUS_NETSHIM_SOCKS is not set (connects to peers fail with "
                     "ENETUNREACH)%s",
                     "");
    }
}

int netshim_peer_match(const struct sockaddr *sa, socklen_t len, struct netshim_dest *out)
{
    if (sa == NULL)
        return 0;
    if (sa->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)sa;
        for (size_t i = 0; i < netshim_cfg.n_peers4; i++) {
            if (netshim_cfg.peers4[i].s_addr == in->sin_addr.s_addr) {
                out->family = AF_INET;
                out->addr.v4 = in->sin_addr;
                out->port = in->sin_port;
                return 1;
            }
        }
        return 0;
    }
    if (sa->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)sa;
        if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {
            struct in_addr v4;
            memcpy(&v4, &in6->sin6_addr.s6_addr[12], 4);
            for (size_t i = 0; i < netshim_cfg.n_peers4; i++) {
                if (netshim_cfg.peers4[i].s_addr == v4.s_addr) {
                    out->family = AF_INET;
                    out->addr.v4 = v4;
                    out->port = in6->sin6_port;
                    return 1;
                }
            }
            return 0;
        }
        for (size_t i = 0; i < netshim_cfg.n_peers6; i++) {
            if (memcmp(&netshim_cfg.peers6[i], &in6->sin6_addr, sizeof(struct in6_addr)) == 0) {
                out->family = AF_INET6;
                out->addr.v6 = in6->sin6_addr;
                out->port = in6->sin6_port;
                return 1;
            }
        }
    }
    return 0;
}

void netshim_format_dest(const struct netshim_dest *d, char *buf, size_t size)
{
    char ip[INET6_ADDRSTRLEN];
    if (inet_ntop(d->family, &d->addr, ip, sizeof ip) == NULL)
        snprintf(ip, sizeof ip, "?");
    if (d->family == AF_INET6)
        snprintf(buf, size, "[%s]:%u", ip, (unsigned)ntohs(d->port));
    else
        snprintf(buf, size, "%s:%u", ip, (unsigned)ntohs(d->port));
}
