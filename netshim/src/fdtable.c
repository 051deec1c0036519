/* Which file descriptors the shim redirected, and the peer each one was meant for, so that
 * getpeername() answers with the peer rather than the SOCKS endpoint.
 *
 * Lock-free, so it is safe in any thread and in a child after fork (no lock can be held
 * across fork): a two-level table indexed by fd, chunks of 1024 slots allocated on first use
 * with mmap and installed with compare-and-swap; each slot is a small seqlock.
 *
 * A slot also records the socket's identity (SO_COOKIE, unique for the life of the system,
 * or its inode on older kernels). close, dup, dup2, dup3 and fcntl(F_DUPFD*) keep the table
 * right; the identity check catches every path the hooks do not see (an fd closed inside
 * libc by fclose, close_range, a raw syscall), so a reused fd number never inherits a stale
 * peer, and a dup made behind the shim's back is still found by identity.
 */
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "netshim.h"

#define CHUNK_BITS 10
#define CHUNK_SIZE (1u << CHUNK_BITS)
#define MAX_CHUNKS 4096u /* fds below 4,194,304 */

struct slot {
    unsigned seq; /* odd while a writer is inside */
    int valid;
    uint64_t identity;
    socklen_t len;
    union {
        struct sockaddr_in v4;
        struct sockaddr_in6 v6;
    } peer;
};

static struct slot *chunks[MAX_CHUNKS];
static int any_redirected;

int netshim_fd_any(void)
{
    return __atomic_load_n(&any_redirected, __ATOMIC_RELAXED);
}

static struct slot *slot_for(int fd, int create)
{
    if (fd < 0 || (unsigned)fd >= CHUNK_SIZE * MAX_CHUNKS)
        return NULL;
    unsigned index = (unsigned)fd >> CHUNK_BITS;
    struct slot *chunk = __atomic_load_n(&chunks[index], __ATOMIC_ACQUIRE);
    if (chunk == NULL) {
        if (!create)
            return NULL;
        void *fresh = mmap(NULL, CHUNK_SIZE * sizeof(struct slot), PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (fresh == MAP_FAILED)
            return NULL;
        struct slot *expected = NULL;
        if (__atomic_compare_exchange_n(&chunks[index], &expected, (struct slot *)fresh, 0,
                                        __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            chunk = fresh;
        } else {
            munmap(fresh, CHUNK_SIZE * sizeof(struct slot));
            chunk = expected;
        }
    }
    return &chunk[(unsigned)fd & (CHUNK_SIZE - 1)];
}

/* In a child after fork, a slot another thread of the parent was writing at that instant
 * would stay "being written" forever (its writer does not exist in the child): forget it.
 * The child loses getpeername for that one fd rather than ever get a torn answer. */
void netshim_fd_after_fork_child(void)
{
    if (!netshim_fd_any())
        return;
    for (unsigned c = 0; c < MAX_CHUNKS; c++) {
        struct slot *chunk = __atomic_load_n(&chunks[c], __ATOMIC_RELAXED);
        if (chunk == NULL)
            continue;
        for (unsigned i = 0; i < CHUNK_SIZE; i++) {
            if (chunk[i].seq & 1u) {
                chunk[i].valid = 0;
                chunk[i].seq++;
            }
        }
    }
}

uint64_t netshim_socket_identity(int fd)
{
    uint64_t cookie = 0;
    socklen_t len = sizeof cookie;
    if (getsockopt(fd, SOL_SOCKET, SO_COOKIE, &cookie, &len) == 0 && cookie != 0)
        return cookie;
    /* Kernels before 4.12: the sockfs inode (raw syscall: fstat's symbol version moved in
     * glibc 2.33, and the shim must load into older images too). */
    struct stat st;
    if (syscall(SYS_fstat, fd, &st) == 0)
        return (uint64_t)st.st_ino | ((uint64_t)1 << 63);
    return 0;
}

static void slot_write(struct slot *s, int valid, uint64_t identity, const void *peer,
                       socklen_t len)
{
    __atomic_fetch_add(&s->seq, 1, __ATOMIC_ACQ_REL);
    s->valid = valid;
    s->identity = identity;
    s->len = len;
    if (peer != NULL && len <= sizeof s->peer)
        memcpy(&s->peer, peer, len);
    __atomic_fetch_add(&s->seq, 1, __ATOMIC_RELEASE);
}

/* Copies a consistent snapshot of the slot; 0 when valid. */
static int slot_read(struct slot *s, struct slot *out)
{
    for (int attempt = 0; attempt < 64; attempt++) {
        unsigned before = __atomic_load_n(&s->seq, __ATOMIC_ACQUIRE);
        if (before & 1u)
            continue;
        if (!__atomic_load_n(&s->valid, __ATOMIC_RELAXED))
            return -1;
        memcpy(out, s, sizeof *out);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&s->seq, __ATOMIC_RELAXED) == before)
            return out->valid ? 0 : -1;
    }
    return -1;
}

void netshim_fd_set(int fd, uint64_t identity, const struct sockaddr *peer, socklen_t len)
{
    struct slot *s = slot_for(fd, 1);
    if (s == NULL) {
        netshim_debug("fd %d is beyond the table: getpeername will name the endpoint", fd);
        return;
    }
    if (len > sizeof s->peer)
        len = sizeof s->peer;
    slot_write(s, 1, identity, peer, len);
    __atomic_store_n(&any_redirected, 1, __ATOMIC_RELAXED);
}

void netshim_fd_clear(int fd)
{
    struct slot *s = slot_for(fd, 0);
    if (s != NULL && __atomic_load_n(&s->valid, __ATOMIC_RELAXED))
        slot_write(s, 0, 0, NULL, 0);
}

void netshim_fd_copy(int from, int to)
{
    if (from == to)
        return;
    struct slot *src = slot_for(from, 0);
    struct slot snapshot;
    if (src != NULL && slot_read(src, &snapshot) == 0) {
        struct slot *dst = slot_for(to, 1);
        if (dst != NULL)
            slot_write(dst, 1, snapshot.identity, &snapshot.peer, snapshot.len);
        return;
    }
    netshim_fd_clear(to);
}

static int found(const struct slot *snapshot, struct sockaddr_storage *peer, socklen_t *len)
{
    memset(peer, 0, sizeof *peer);
    memcpy(peer, &snapshot->peer, snapshot->len);
    *len = snapshot->len;
    return 0;
}

int netshim_fd_lookup(int fd, struct sockaddr_storage *peer, socklen_t *len)
{
    uint64_t identity = netshim_socket_identity(fd);
    if (identity == 0)
        return -1;
    struct slot snapshot;
    struct slot *s = slot_for(fd, 0);
    if (s != NULL && slot_read(s, &snapshot) == 0) {
        if (snapshot.identity == identity)
            return found(&snapshot, peer, len);
        netshim_fd_clear(fd); /* stale: that socket was closed behind our back */
    }
    /* Not under this number: a dup the hooks did not see. Same socket, same identity. */
    for (unsigned c = 0; c < MAX_CHUNKS; c++) {
        struct slot *chunk = __atomic_load_n(&chunks[c], __ATOMIC_ACQUIRE);
        if (chunk == NULL)
            continue;
        for (unsigned i = 0; i < CHUNK_SIZE; i++) {
            if (slot_read(&chunk[i], &snapshot) == 0 && snapshot.identity == identity) {
                netshim_fd_set(fd, identity, (const struct sockaddr *)&snapshot.peer,
                               snapshot.len);
                return found(&snapshot, peer, len);
            }
        }
    }
    return -1;
}
