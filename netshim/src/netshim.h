/* libnodus-netshim: internal interfaces shared by the shim's files.
 *
 * Everything here has hidden visibility (the library is built with -fvisibility=hidden): the
 * only symbols the shim exports are the libc functions it interposes (hooks.c).
 */
#ifndef NODUS_NETSHIM_H
#define NODUS_NETSHIM_H

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>

/* ---- config.c: the environment, parsed once in the constructor ------------------------- */

/* A destination the shim redirects: an IPv4 or IPv6 address (IPv4-mapped IPv6 addresses are
 * reduced to IPv4) and a port, in network byte order. */
struct netshim_dest {
    int family; /* AF_INET or AF_INET6 */
    union {
        struct in_addr v4;
        struct in6_addr v6;
    } addr;
    in_port_t port;
};

struct netshim_config {
    int active;   /* at least one peer: connect() looks at destinations */
    int socks_ok; /* NODUS_NETSHIM_SOCKS parsed */
    struct netshim_dest socks;
    char socks_text[64]; /* as given, for messages */
    struct in_addr *peers4;
    size_t n_peers4;
    struct in6_addr *peers6;
    size_t n_peers6;
    int debug;
    int timeout_ms;   /* bound on one redirected connect (NODUS_NETSHIM_TIMEOUT_MS) */
    char error[200];  /* the first configuration problem, "" when none */
};

extern struct netshim_config netshim_cfg;

void netshim_config_load(void);
/* Parses "host:port" with an IPv4 literal, "[v6]:port" or "v6:port" (last colon). */
int netshim_parse_endpoint(const char *text, struct netshim_dest *out);
/* Is this sockaddr one of the peers? Fills *out (address reduced, port) when it is. */
int netshim_peer_match(const struct sockaddr *sa, socklen_t len, struct netshim_dest *out);
/* Formats a destination as "1.2.3.4:80" or "[::1]:80". */
void netshim_format_dest(const struct netshim_dest *d, char *buf, size_t size);

/* ---- log.c: silent unless NODUS_NETSHIM_DEBUG ------------------------------------------- */

void netshim_debug(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void netshim_write_marker(void);

/* ---- real.c: the libc functions behind the hooks ---------------------------------------- */

struct netshim_real {
    int (*connect)(int, const struct sockaddr *, socklen_t);
    int (*getpeername)(int, struct sockaddr *, socklen_t *);
    int (*close)(int);
    int (*dup)(int);
    int (*dup2)(int, int);
    int (*dup3)(int, int, int);
    int (*fcntl)(int, int, ...);
    int (*fcntl64)(int, int, ...);
    ssize_t (*sendto)(int, const void *, size_t, int, const struct sockaddr *, socklen_t);
    ssize_t (*sendmsg)(int, const struct msghdr *, int);
};

extern struct netshim_real netshim_real;
void netshim_resolve(void);

/* ---- fdtable.c: which fds the shim redirected, and to where ----------------------------- */

/* The identity of a socket, stable across dup() and fork(): its SO_COOKIE (or, on kernels
 * before 4.12, its sockfs inode). 0 = unknown. */
uint64_t netshim_socket_identity(int fd);
void netshim_fd_set(int fd, uint64_t identity, const struct sockaddr *peer, socklen_t len);
void netshim_fd_clear(int fd);
void netshim_fd_copy(int from, int to);
/* Copies the recorded peer of fd into *peer and *len (a full sockaddr, len = its size) when
 * fd is a socket the shim redirected; 0 when found, -1 when not. */
int netshim_fd_lookup(int fd, struct sockaddr_storage *peer, socklen_t *len);
/* Has anything ever been redirected in this process? Lets every hook skip the table. */
int netshim_fd_any(void);
/* pthread_atfork child handler: drops slots caught mid-write by the fork. */
void netshim_fd_after_fork_child(void);

/* ---- socks5.c: the client side of the SOCKS5 CONNECT handshake -------------------------- */

/* Result of a redirected connect: 0 or an errno value, plus what happened for the log. */
struct netshim_outcome {
    int error;      /* 0 = connected through the endpoint */
    int socks_reply; /* the reply code (0..255) when the endpoint answered, -1 otherwise */
    const char *what; /* a short explanation for the debug log */
};

/* Runs greeting + CONNECT on fd, already connected to the SOCKS endpoint, until
 * deadline_ms (CLOCK_MONOTONIC milliseconds). Reads exactly the reply, never past it. */
struct netshim_outcome netshim_socks5_handshake(int fd, const struct netshim_dest *dst,
                                                int64_t deadline_ms);
/* Maps a SOCKS5 reply code to the errno a direct connect() would have given. */
int netshim_errno_for_reply(int reply);
int64_t netshim_now_ms(void);
/* Waits for events on fd until the deadline; 1 ready, 0 timed out, -1 error (errno). */
int netshim_wait(int fd, short events, int64_t deadline_ms);

/* ---- redirect.c ------------------------------------------------------------------------- */

/* connect() for a destination that is a peer, on a TCP socket. Returns like connect(). */
int netshim_redirect(int fd, const struct sockaddr *addr, socklen_t len,
                     const struct netshim_dest *dst);
/* Is fd a TCP socket of the same family as addr? */
int netshim_is_tcp(int fd, int family);

#endif
