/* Debug lines (only with NODUS_NETSHIM_DEBUG) and the load marker (only with
 * NODUS_NETSHIM_MARKER). Both use write(2) on a stack buffer: no stdio locks, so they are
 * safe in any thread and in a child right after fork. errno is preserved. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "netshim.h"

void netshim_debug(const char *fmt, ...)
{
    if (!netshim_cfg.debug)
        return;
    int saved = errno;
    char line[512];
    int n = snprintf(line, sizeof line, "nodus-netshim[%d]: ", (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof line - 2)
        len = sizeof line - 2;
    line[len++] = '\n';
    ssize_t ignored = write(STDERR_FILENO, line, len);
    (void)ignored;
    errno = saved;
}

/* One line per process that loaded the shim, appended (one write, O_APPEND: lines from
 * concurrent processes do not interleave):
 *   pid=123 ppid=100 peers=2 socks=127.0.0.1:1080 exe=/usr/bin/python3.11 config=ok
 * nodus-shim-check reads it; `config=` carries the first configuration problem, if any. */
void netshim_write_marker(void)
{
    const char *path = getenv("NODUS_NETSHIM_MARKER");
    if (path == NULL || path[0] == '\0')
        return;
    int saved = errno;
    char exe[256];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    exe[n > 0 ? n : 0] = '\0';
    char line[768];
    int len = snprintf(line, sizeof line, "pid=%d ppid=%d peers=%zu socks=%s exe=%s config=%s\n",
                       (int)getpid(), (int)getppid(),
                       netshim_cfg.n_peers4 + netshim_cfg.n_peers6,
                       netshim_cfg.socks_ok ? netshim_cfg.socks_text : "-", exe[0] ? exe : "?",
                       netshim_cfg.error[0] ? netshim_cfg.error : "ok");
    if (len > (int)sizeof line - 1) {
        len = (int)sizeof line - 1;
        line[len - 1] = '\n';
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) {
        ssize_t ignored = write(fd, line, (size_t)len);
        (void)ignored;
        netshim_real.close(fd);
    }
    errno = saved;
}
