/* The programs tests/bench/shim.py times, so that the figures are the network's and the
 * shim's, not an interpreter's. One JSON object on stdout.
 *
 *   netbench sink    HOST PORT          listen (PORT 0: any), print {"port":N}, then accept
 *                                       forever; each connection is read to EOF and closed
 *   netbench connect HOST PORT N        N blocking connects, each closed at once; the time
 *                                       of each connect() in microseconds
 *   netbench stream  HOST PORT BYTES    send BYTES, shut down the write side, wait for the
 *                                       sink's close: end-to-end seconds
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define CHUNK (256 * 1024)

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static struct addrinfo *resolve(const char *host, const char *port, int passive)
{
    struct addrinfo hints = {.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV | (passive ? AI_PASSIVE : 0),
                             .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    if (getaddrinfo(host, port, &hints, &res) != 0 || res == NULL) {
        fprintf(stderr, "netbench: bad address %s %s\n", host, port);
        exit(2);
    }
    return res;
}

static void *drain(void *arg)
{
    int fd = (int)(long)arg;
    static __thread char buf[CHUNK];
    while (recv(fd, buf, sizeof buf, 0) > 0) {
    }
    close(fd);
    return NULL;
}

static int sink(const char *host, const char *port)
{
    struct addrinfo *ai = resolve(host, port, 1);
    int fd = socket(ai->ai_family, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 4096) != 0) {
        perror("netbench sink");
        return 1;
    }
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    getsockname(fd, (struct sockaddr *)&ss, &len);
    char service[16];
    getnameinfo((struct sockaddr *)&ss, len, NULL, 0, service, sizeof service, NI_NUMERICSERV);
    printf("{\"port\":%s}\n", service);
    fflush(stdout);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    for (;;) {
        int c = accept(fd, NULL, NULL);
        if (c < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE)
                continue;
            return 1;
        }
        pthread_t t;
        if (pthread_create(&t, &attr, drain, (void *)(long)c) != 0)
            close(c);
    }
}

static int connects(const char *host, const char *port, int n)
{
    struct addrinfo *ai = resolve(host, port, 0);
    printf("{\"samples_us\":[");
    int failures = 0;
    for (int i = 0; i < n; i++) {
        int fd = socket(ai->ai_family, SOCK_STREAM, 0);
        double start = now_s();
        int r = connect(fd, ai->ai_addr, ai->ai_addrlen);
        double took = now_s() - start;
        if (r != 0)
            failures++;
        else
            printf("%s%.2f", i - failures == 0 ? "" : ",", took * 1e6);
        close(fd);
    }
    printf("],\"failures\":%d}\n", failures);
    return failures ? 1 : 0;
}

static int stream(const char *host, const char *port, long long bytes)
{
    struct addrinfo *ai = resolve(host, port, 0);
    int fd = socket(ai->ai_family, SOCK_STREAM, 0);
    double t0 = now_s();
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
        perror("netbench stream");
        return 1;
    }
    double t1 = now_s();
    static char buf[CHUNK];
    memset(buf, 'x', sizeof buf);
    long long sent = 0;
    while (sent < bytes) {
        size_t want = bytes - sent < CHUNK ? (size_t)(bytes - sent) : CHUNK;
        ssize_t n = send(fd, buf, want, MSG_NOSIGNAL);
        if (n <= 0) {
            perror("netbench stream send");
            return 1;
        }
        sent += n;
    }
    shutdown(fd, SHUT_WR);
    while (recv(fd, buf, sizeof buf, 0) > 0) {
    }
    double t2 = now_s();
    close(fd);
    printf("{\"bytes\":%lld,\"seconds\":%.6f,\"connect_ms\":%.3f}\n", sent, t2 - t1,
           (t1 - t0) * 1e3);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: netbench sink|connect|stream HOST PORT [N|BYTES]\n");
        return 2;
    }
    if (strcmp(argv[1], "sink") == 0)
        return sink(argv[2], argv[3]);
    if (strcmp(argv[1], "connect") == 0 && argc > 4)
        return connects(argv[2], argv[3], atoi(argv[4]));
    if (strcmp(argv[1], "stream") == 0 && argc > 4)
        return stream(argv[2], argv[3], atoll(argv[4]));
    fprintf(stderr, "netbench: unknown mode %s\n", argv[1]);
    return 2;
}
