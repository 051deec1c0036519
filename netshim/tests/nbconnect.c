/* A client the way NCCL and Gloo write one: non-blocking connect(), poll() for POLLOUT, then
 * getsockopt(SO_ERROR). The shim tests run it with the shim preloaded. One JSON object per
 * line on stdout.
 *
 *   nbconnect connect  HOST PORT [MSG]   non-blocking connect, send MSG, read the echo
 *   nbconnect blocking HOST PORT [MSG]   the same on a blocking socket
 *   nbconnect retry    HOST PORT MAX_MS  connect again on the same fd after each ECONNREFUSED
 *   nbconnect threads  HOST PORT N       N threads connect and echo at once
 *   nbconnect fork     HOST PORT         connect; fork; the child uses the inherited socket
 *                                        and makes a connection of its own
 *   nbconnect dup      HOST PORT         getpeername through dup, dup2, dup3, F_DUPFD_CLOEXEC
 *                                        after the original is closed
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *errno_name(int e)
{
    switch (e) {
    case 0: return "0";
    case ECONNREFUSED: return "ECONNREFUSED";
    case ETIMEDOUT: return "ETIMEDOUT";
    case EHOSTUNREACH: return "EHOSTUNREACH";
    case ENETUNREACH: return "ENETUNREACH";
    case EACCES: return "EACCES";
    case EPERM: return "EPERM";
    case ECONNABORTED: return "ECONNABORTED";
    case ECONNRESET: return "ECONNRESET";
    case EPROTO: return "EPROTO";
    case EAFNOSUPPORT: return "EAFNOSUPPORT";
    case EINPROGRESS: return "EINPROGRESS";
    case EISCONN: return "EISCONN";
    case EALREADY: return "EALREADY";
    case EINVAL: return "EINVAL";
    default: return "OTHER";
    }
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000.0 + ts.tv_nsec / 1e6;
}

struct target {
    struct sockaddr_storage addr;
    socklen_t len;
};

static int parse_target(const char *host, const char *port, struct target *t)
{
    struct addrinfo hints = {.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV,
                             .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    if (getaddrinfo(host, port, &hints, &res) != 0 || res == NULL)
        return -1;
    memcpy(&t->addr, res->ai_addr, res->ai_addrlen);
    t->len = res->ai_addrlen;
    freeaddrinfo(res);
    return 0;
}

static void format_addr(const struct sockaddr_storage *ss, char *buf, size_t size)
{
    char ip[INET6_ADDRSTRLEN] = "?";
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)ss;
        inet_ntop(AF_INET, &in->sin_addr, ip, sizeof ip);
        snprintf(buf, size, "%s:%u", ip, ntohs(in->sin_port));
    } else if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)ss;
        inet_ntop(AF_INET6, &in6->sin6_addr, ip, sizeof ip);
        snprintf(buf, size, "[%s]:%u", ip, ntohs(in6->sin6_port));
    } else {
        snprintf(buf, size, "family-%d", ss->ss_family);
    }
}

static void peer_of(int fd, char *buf, size_t size)
{
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (getpeername(fd, (struct sockaddr *)&ss, &len) != 0)
        snprintf(buf, size, "error:%s", errno_name(errno));
    else
        format_addr(&ss, buf, size);
}

/* connect() as NCCL does it: returns 0 or -1 with errno; *how says what connect returned. */
static int nb_connect(int fd, const struct target *t, const char **how, const char **stage)
{
    *stage = "connect";
    if (connect(fd, (const struct sockaddr *)&t->addr, t->len) == 0) {
        *how = "0";
        return 0;
    }
    if (errno != EINPROGRESS) {
        *how = errno_name(errno);
        return -1;
    }
    *how = "EINPROGRESS";
    *stage = "so_error";
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    if (poll(&p, 1, 20000) != 1) {
        errno = ETIMEDOUT;
        return -1;
    }
    int err = 0;
    socklen_t len = sizeof err;
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
        errno = err;
        return -1;
    }
    return 0;
}

/* Sends msg and reads the same number of bytes back, waiting with poll. */
static int echo(int fd, const char *msg, char *out, size_t size)
{
    size_t len = strlen(msg), sent = 0, got = 0;
    if (len >= size)
        return -1;
    while (sent < len) {
        ssize_t n = send(fd, msg + sent, len - sent, MSG_NOSIGNAL);
        if (n > 0) {
            sent += (size_t)n;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            struct pollfd p = {.fd = fd, .events = POLLOUT};
            poll(&p, 1, 10000);
        } else {
            return -1;
        }
    }
    while (got < len) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 10000) != 1)
            return -1;
        ssize_t n = recv(fd, out + got, len - got, 0);
        if (n <= 0)
            return -1;
        got += (size_t)n;
    }
    out[got] = '\0';
    return 0;
}

static int mode_connect(const struct target *t, const char *msg, int nonblock)
{
    int fd = socket(t->addr.ss_family, SOCK_STREAM | (nonblock ? SOCK_NONBLOCK : 0), 0);
    const char *how, *stage;
    double start = now_ms();
    if (nb_connect(fd, t, &how, &stage) != 0) {
        printf("{\"result\":\"error\",\"errno\":\"%s\",\"stage\":\"%s\",\"ms\":%.3f}\n",
               errno_name(errno), stage, now_ms() - start);
        return 1;
    }
    double ms = now_ms() - start;
    int still_nonblock = (fcntl(fd, F_GETFL) & O_NONBLOCK) != 0;
    char peer[80], reply[256];
    peer_of(fd, peer, sizeof peer);
    int ok = echo(fd, msg, reply, sizeof reply) == 0;
    printf("{\"result\":\"%s\",\"connect_returned\":\"%s\",\"nonblock\":%s,\"peer\":\"%s\","
           "\"echo\":\"%s\",\"ms\":%.3f}\n",
           ok ? "ok" : "echo-failed", how, still_nonblock ? "true" : "false", peer,
           ok ? reply : "", ms);
    close(fd);
    return ok ? 0 : 1;
}

static int mode_retry(const struct target *t, int max_ms)
{
    int fd = socket(t->addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int refused = 0;
    double deadline = now_ms() + max_ms;
    while (now_ms() < deadline) {
        const char *how, *stage;
        if (nb_connect(fd, t, &how, &stage) == 0) {
            char peer[80], reply[64];
            peer_of(fd, peer, sizeof peer);
            int ok = echo(fd, "again", reply, sizeof reply) == 0;
            printf("{\"result\":\"%s\",\"refused\":%d,\"peer\":\"%s\",\"same_fd\":%d}\n",
                   ok ? "ok" : "echo-failed", refused, peer, fd);
            return ok ? 0 : 1;
        }
        if (errno != ECONNREFUSED) {
            printf("{\"result\":\"error\",\"errno\":\"%s\",\"refused\":%d}\n", errno_name(errno),
                   refused);
            return 1;
        }
        if (refused++ == 0) {
            printf("{\"event\":\"refused\"}\n");
            fflush(stdout);
        }
        struct timespec pause = {0, 20 * 1000 * 1000};
        nanosleep(&pause, NULL);
    }
    printf("{\"result\":\"gave-up\",\"refused\":%d}\n", refused);
    return 1;
}

struct job {
    const struct target *t;
    int index;
    int ok;
    char peer[80];
};

static void *thread_main(void *arg)
{
    struct job *j = arg;
    int fd = socket(j->t->addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK, 0);
    const char *how, *stage;
    char msg[32], reply[64];
    snprintf(msg, sizeof msg, "thread-%d", j->index);
    if (nb_connect(fd, j->t, &how, &stage) == 0 && echo(fd, msg, reply, sizeof reply) == 0 &&
        strcmp(msg, reply) == 0) {
        peer_of(fd, j->peer, sizeof j->peer);
        j->ok = 1;
    }
    close(fd);
    return NULL;
}

static int mode_threads(const struct target *t, int n)
{
    pthread_t threads[256];
    struct job jobs[256];
    if (n > 256)
        n = 256;
    for (int i = 0; i < n; i++) {
        jobs[i] = (struct job){.t = t, .index = i};
        pthread_create(&threads[i], NULL, thread_main, &jobs[i]);
    }
    int ok = 0;
    char expected[80];
    format_addr(&t->addr, expected, sizeof expected);
    for (int i = 0; i < n; i++) {
        pthread_join(threads[i], NULL);
        ok += jobs[i].ok && strcmp(jobs[i].peer, expected) == 0;
    }
    printf("{\"result\":\"%s\",\"threads\":%d,\"ok\":%d}\n", ok == n ? "ok" : "failed", n, ok);
    return ok == n ? 0 : 1;
}

static int mode_fork(const struct target *t)
{
    int fd = socket(t->addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK, 0);
    const char *how, *stage;
    if (nb_connect(fd, t, &how, &stage) != 0) {
        printf("{\"result\":\"error\",\"errno\":\"%s\"}\n", errno_name(errno));
        return 1;
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        char inherited[80], own[80], reply[64];
        peer_of(fd, inherited, sizeof inherited);
        int inherited_ok = echo(fd, "from-child", reply, sizeof reply) == 0;
        int fd2 = socket(t->addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK, 0);
        int own_ok = nb_connect(fd2, t, &how, &stage) == 0 &&
                     echo(fd2, "child-own", reply, sizeof reply) == 0;
        peer_of(fd2, own, sizeof own);
        printf("{\"who\":\"child\",\"inherited_peer\":\"%s\",\"inherited_ok\":%s,"
               "\"own_peer\":\"%s\",\"own_ok\":%s}\n",
               inherited, inherited_ok ? "true" : "false", own, own_ok ? "true" : "false");
        fflush(stdout);
        _exit(inherited_ok && own_ok ? 0 : 1);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    char peer[80], reply[64];
    peer_of(fd, peer, sizeof peer);
    int ok = echo(fd, "from-parent", reply, sizeof reply) == 0;
    printf("{\"who\":\"parent\",\"peer\":\"%s\",\"ok\":%s,\"child_status\":%d}\n", peer,
           ok ? "true" : "false", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    return ok && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}

static int mode_dup(const struct target *t)
{
    int fd = socket(t->addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK, 0);
    const char *how, *stage;
    if (nb_connect(fd, t, &how, &stage) != 0) {
        printf("{\"result\":\"error\",\"errno\":\"%s\"}\n", errno_name(errno));
        return 1;
    }
    int a = dup(fd);
    int b = dup2(fd, 100);
    int c = dup3(fd, 101, O_CLOEXEC);
    int d = fcntl(fd, F_DUPFD_CLOEXEC, 200);
    close(fd);
    /* A new, unrelated socket takes the closed number: it must not inherit the record. */
    int other = socket(AF_INET, SOCK_STREAM, 0);
    char pa[80], pb[80], pc[80], pd[80], po[80], reply[64];
    peer_of(a, pa, sizeof pa);
    peer_of(b, pb, sizeof pb);
    peer_of(c, pc, sizeof pc);
    peer_of(d, pd, sizeof pd);
    peer_of(other, po, sizeof po);
    int ok = echo(d, "dup", reply, sizeof reply) == 0;
    printf("{\"dup\":\"%s\",\"dup2\":\"%s\",\"dup3\":\"%s\",\"f_dupfd\":\"%s\","
           "\"reused_number\":%s,\"reused_peer\":\"%s\",\"echo_ok\":%s}\n",
           pa, pb, pc, pd, other == fd ? "true" : "false", po, ok ? "true" : "false");
    return ok ? 0 : 1;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: nbconnect connect|blocking|retry|threads|fork|dup HOST PORT ...\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    struct target t;
    if (parse_target(argv[2], argv[3], &t) != 0) {
        fprintf(stderr, "nbconnect: bad address %s %s\n", argv[2], argv[3]);
        return 2;
    }
    const char *mode = argv[1];
    const char *arg = argc > 4 ? argv[4] : NULL;
    if (strcmp(mode, "connect") == 0)
        return mode_connect(&t, arg ? arg : "ping", 1);
    if (strcmp(mode, "blocking") == 0)
        return mode_connect(&t, arg ? arg : "ping", 0);
    if (strcmp(mode, "retry") == 0)
        return mode_retry(&t, arg ? atoi(arg) : 5000);
    if (strcmp(mode, "threads") == 0)
        return mode_threads(&t, arg ? atoi(arg) : 16);
    if (strcmp(mode, "fork") == 0)
        return mode_fork(&t);
    if (strcmp(mode, "dup") == 0)
        return mode_dup(&t);
    fprintf(stderr, "nbconnect: unknown mode %s\n", mode);
    return 2;
}
