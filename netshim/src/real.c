/* The real libc functions behind the hooks, found with dlsym(RTLD_NEXT) in the constructor
 * (and on first use, should another library's constructor call a hook before ours ran). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

#include "netshim.h"

/* Bind to the oldest dlsym so the library also loads into images with a glibc older than
 * the build machine's (glibc 2.34 moved dlsym into libc under a new version; the old one is
 * still exported). The Makefile keeps libdl.so.2 as a dependency for those older images. */
#if defined(__GLIBC__) && defined(__x86_64__)
__asm__(".symver dlsym,dlsym@GLIBC_2.2.5");
#elif defined(__GLIBC__) && defined(__aarch64__)
__asm__(".symver dlsym,dlsym@GLIBC_2.17");
#endif

struct netshim_real netshim_real;

static void *next(const char *name)
{
    return dlsym(RTLD_NEXT, name);
}

void netshim_resolve(void)
{
    /* Each pointer is written with the same value by whichever thread gets here: a benign
     * race, and the stores are pointer-sized (atomic on every target glibc supports). */
    if (netshim_real.connect != NULL)
        return;
    netshim_real.getpeername = (int (*)(int, struct sockaddr *, socklen_t *))next("getpeername");
    netshim_real.close = (int (*)(int))next("close");
    netshim_real.dup = (int (*)(int))next("dup");
    netshim_real.dup2 = (int (*)(int, int))next("dup2");
    netshim_real.dup3 = (int (*)(int, int, int))next("dup3");
    netshim_real.fcntl = (int (*)(int, int, ...))next("fcntl");
    netshim_real.fcntl64 = (int (*)(int, int, ...))next("fcntl64");
    if (netshim_real.fcntl64 == NULL) /* glibc before 2.28 */
        netshim_real.fcntl64 = netshim_real.fcntl;
    netshim_real.sendto = (ssize_t(*)(int, const void *, size_t, int, const struct sockaddr *,
                                      socklen_t))next("sendto");
    netshim_real.sendmsg = (ssize_t(*)(int, const struct msghdr *, int))next("sendmsg");
    __atomic_store_n(&netshim_real.connect,
                     (int (*)(int, const struct sockaddr *, socklen_t))next("connect"),
                     __ATOMIC_RELEASE);
}
