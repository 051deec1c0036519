/* nodus-shim-check: does the shim load into this launcher? (G10.3, G20)
 *
 *   nodus-shim-check [--shim PATH] [--timeout SECONDS] [--json] [--] LAUNCHER [ARG...]
 *
 * Runs LAUNCHER ARG... (found in PATH like execvp) with the shim first in LD_PRELOAD (then
 * whatever LD_PRELOAD already held, as the placer renders it) and NODUS_NETSHIM_MARKER set to
 * a fresh file; the shim's constructor appends a line there from every process it loads into.
 * The shim loaded if a line carries the launcher's pid. Separately, it reads the launcher's
 * file (following #! lines, and `env NAME`) to say why when it did not: no PT_INTERP =
 * statically linked, an ld-musl interpreter = musl, another architecture, or what the
 * dynamic loader printed.
 *
 * The launcher runs with stdin and stdout on /dev/null and its stderr captured; it is killed
 * (with its process group) after --timeout seconds (default 30). The shim loads before main,
 * so a launcher that exits with an error or is killed still proves the load.
 *
 * Exit status:
 *   0  the shim loaded into the launcher
 *   1  ShimNotLoaded: the launcher ran and the shim did not load, or it is a musl program
 *      (the shim is built and qualified for glibc only, G20)
 *   2  usage error
 *   3  the check could not run: launcher not found or not executable, shim missing, no
 *      temporary directory
 * stdout: one line, "ok: ...", "ShimNotLoaded: ..." or "error: ..."; with --json one JSON
 * object instead (fields: see README "The shim").
 *
 * Built statically (see the Makefile), so it runs inside any image: glibc, musl or none.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "elf.h"

extern char **environ;

enum { EXIT_LOADED = 0, EXIT_NOT_LOADED = 1, EXIT_USAGE = 2, EXIT_CHECK_FAILED = 3 };

#define ADVICE                                                                              \
    "Use a glibc-based image whose launcher is dynamically linked (Debian, Ubuntu, RHEL "   \
    "based; not Alpine, not static or distroless-static), or set transport: Direct."

struct report {
    int exit_code;
    const char *reason; /* "ShimNotLoaded", "CheckFailed" or NULL */
    const char *launcher;
    char resolved[PATH_MAX];
    char target[PATH_MAX];
    struct elf_info elf;
    char shim[PATH_MAX];
    int loaded;
    char markers[4096];
    char loader_message[512];
    char launcher_status[64];
    char message[1536];
};

/* snprintf that truncates on purpose (messages quote paths of any length). */
static void format(char *buf, size_t size, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void format(char *buf, size_t size, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, size, fmt, ap);
    va_end(ap);
}

static void usage(void)
{
    fprintf(stderr,
            "usage: nodus-shim-check [--shim PATH] [--timeout SECONDS] [--json] [--] "
            "LAUNCHER [ARG...]\n"
            "Runs LAUNCHER with libnodus-netshim.so preloaded and reports whether it loaded.\n"
            "Exit status: 0 loaded, 1 ShimNotLoaded, 2 usage, 3 the check could not run.\n");
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* execvp's search: a name with a slash is a path; otherwise the first executable in PATH. */
static int resolve(const char *name, char *out, size_t size)
{
    if (strchr(name, '/') != NULL) {
        snprintf(out, size, "%s", name);
        return access(out, X_OK) == 0 ? 0 : -1;
    }
    const char *path = getenv("PATH");
    if (path == NULL || path[0] == '\0')
        path = "/usr/local/bin:/usr/bin:/bin";
    while (*path != '\0') {
        const char *end = strchr(path, ':');
        size_t n = end ? (size_t)(end - path) : strlen(path);
        snprintf(out, size, "%.*s/%s", (int)n, n ? path : ".", name);
        struct stat st;
        if (stat(out, &st) == 0 && S_ISREG(st.st_mode) && access(out, X_OK) == 0)
            return 0;
        path += n;
        if (*path == ':')
            path++;
    }
    errno = ENOENT;
    return -1;
}

/* From the launcher to the ELF file the kernel finally runs: follow #! (and `env NAME`). */
static void find_target(struct report *r)
{
    snprintf(r->target, sizeof r->target, "%s", r->resolved);
    for (int depth = 0; depth < 4; depth++) {
        char interp[PATH_MAX], arg[PATH_MAX];
        if (script_interpreter(r->target, interp, sizeof interp, arg, sizeof arg) != 1)
            return;
        const char *base = strrchr(interp, '/');
        base = base ? base + 1 : interp;
        if (strcmp(base, "env") == 0 && arg[0] != '\0') {
            char *name = arg;
            if (strncmp(name, "-S", 2) == 0) /* env -S "python3 -u" */
                name += 2;
            while (*name == ' ')
                name++;
            name[strcspn(name, " \t")] = '\0';
            if (name[0] != '\0' && name[0] != '-' && strchr(name, '=') == NULL &&
                resolve(name, r->target, sizeof r->target) == 0)
                continue;
        }
        snprintf(r->target, sizeof r->target, "%s", interp);
    }
}

static void default_shim(char *out, size_t size)
{
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) {
        snprintf(out, size, "libnodus-netshim.so");
        return;
    }
    self[n] = '\0';
    char *slash = strrchr(self, '/');
    if (slash != NULL)
        *slash = '\0';
    format(out, size, "%s/libnodus-netshim.so", self);
}

/* Builds the launcher's environment: ours, with LD_PRELOAD = shim[:previous] and the marker. */
static char **child_env(const char *shim, const char *marker)
{
    size_t n = 0;
    while (environ[n] != NULL)
        n++;
    char **env = calloc(n + 3, sizeof *env);
    if (env == NULL)
        return NULL;
    size_t k = 0;
    const char *previous = "";
    for (size_t i = 0; i < n; i++) {
        if (strncmp(environ[i], "LD_PRELOAD=", 11) == 0)
            previous = environ[i] + 11;
        else if (strncmp(environ[i], "NODUS_NETSHIM_MARKER=", 21) != 0)
            env[k++] = environ[i];
    }
    size_t size = strlen(shim) + strlen(previous) + 16;
    char *preload = malloc(size);
    char *mark = malloc(strlen(marker) + 32);
    if (preload == NULL || mark == NULL)
        return NULL;
    snprintf(preload, size, "LD_PRELOAD=%s%s%s", shim, previous[0] ? ":" : "", previous);
    snprintf(mark, strlen(marker) + 32, "NODUS_NETSHIM_MARKER=%s", marker);
    env[k++] = preload;
    env[k++] = mark;
    env[k] = NULL;
    return env;
}

/* Runs the launcher; fills its status and what it wrote on stderr, sets *child to its pid.
 * Returns 0, or an errno when it could not be started. */
static int run(struct report *r, char **argv, char **env, int timeout_s, char *errbuf,
               size_t errbuf_size, pid_t *child)
{
    int err_pipe[2], exec_pipe[2];
    if (pipe2(err_pipe, O_CLOEXEC) != 0 || pipe2(exec_pipe, O_CLOEXEC) != 0)
        return errno;
    pid_t pid = fork();
    if (pid < 0)
        return errno;
    if (pid == 0) {
        setpgid(0, 0);
        int null = open("/dev/null", O_RDWR);
        if (null >= 0) {
            dup2(null, STDIN_FILENO);
            dup2(null, STDOUT_FILENO);
        }
        dup2(err_pipe[1], STDERR_FILENO);
        execve(r->resolved, argv, env);
        int e = errno;
        ssize_t ignored = write(exec_pipe[1], &e, sizeof e);
        (void)ignored;
        _exit(127);
    }
    setpgid(pid, pid);
    close(err_pipe[1]);
    close(exec_pipe[1]);
    int exec_errno = 0;
    if (read(exec_pipe[0], &exec_errno, sizeof exec_errno) != (ssize_t)sizeof exec_errno)
        exec_errno = 0;
    close(exec_pipe[0]);

    size_t got = 0;
    int status = 0, exited = 0, timed_out = 0, eof = 0;
    int64_t deadline = now_ms() + (int64_t)timeout_s * 1000;
    int64_t grace_end = 0;
    while (!(exited && (eof || now_ms() >= grace_end))) {
        if (!exited) {
            pid_t w = waitpid(pid, &status, WNOHANG);
            if (w == pid) {
                exited = 1;
                grace_end = now_ms() + 200; /* let the pipe drain; stragglers are killed */
                continue;
            }
            if (now_ms() >= deadline) {
                kill(-pid, SIGKILL);
                waitpid(pid, &status, 0);
                exited = timed_out = 1;
                grace_end = now_ms();
                continue;
            }
        }
        if (eof) {
            struct timespec pause = {0, 5 * 1000 * 1000};
            nanosleep(&pause, NULL);
            continue;
        }
        struct pollfd p = {.fd = err_pipe[0], .events = POLLIN};
        if (poll(&p, 1, 5) > 0) {
            char chunk[1024];
            ssize_t n = read(err_pipe[0], chunk, sizeof chunk);
            if (n <= 0) {
                eof = 1;
            } else if (got < errbuf_size - 1) {
                size_t keep = (size_t)n < errbuf_size - 1 - got ? (size_t)n : errbuf_size - 1 - got;
                memcpy(errbuf + got, chunk, keep);
                got += keep;
            }
        }
    }
    errbuf[got] = '\0';
    close(err_pipe[0]);
    kill(-pid, SIGKILL); /* anything the launcher left running */

    if (exec_errno != 0)
        return exec_errno;
    if (timed_out)
        snprintf(r->launcher_status, sizeof r->launcher_status, "killed after %ds", timeout_s);
    else if (WIFEXITED(status))
        snprintf(r->launcher_status, sizeof r->launcher_status, "exited %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status))
        snprintf(r->launcher_status, sizeof r->launcher_status, "killed by signal %d",
                 WTERMSIG(status));

    *child = pid;
    return 0;
}

static void read_markers(struct report *r, const char *marker, int pid)
{
    int fd = open(marker, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    ssize_t n = read(fd, r->markers, sizeof r->markers - 1);
    close(fd);
    r->markers[n > 0 ? n : 0] = '\0';
    char needle[32];
    snprintf(needle, sizeof needle, "pid=%d ", pid);
    for (char *line = r->markers; line != NULL && *line != '\0';) {
        if (strncmp(line, needle, strlen(needle)) == 0)
            r->loaded = 1;
        line = strchr(line, '\n');
        if (line != NULL)
            line++;
    }
}

static void find_loader_message(struct report *r, const char *stderr_text)
{
    for (const char *line = stderr_text; line != NULL && *line != '\0';) {
        const char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line) : strlen(line);
        char buf[512];
        snprintf(buf, sizeof buf, "%.*s", (int)len, line);
        if (strstr(buf, "ld.so") != NULL || strstr(buf, "LD_PRELOAD") != NULL ||
            strstr(buf, "libnodus-netshim") != NULL || strstr(buf, "Error relocating") != NULL ||
            strstr(buf, "Error loading shared library") != NULL) {
            snprintf(r->loader_message, sizeof r->loader_message, "%s", buf);
            return;
        }
        line = end ? end + 1 : NULL;
    }
}

static void decide(struct report *r, const struct elf_info *shim_elf)
{
    const char *t = r->target;
    int other_arch = r->elf.elf_class != 0 && shim_elf->elf_class != 0 &&
                     (r->elf.elf_class != shim_elf->elf_class ||
                      r->elf.machine != shim_elf->machine);
    r->exit_code = EXIT_NOT_LOADED;
    r->reason = "ShimNotLoaded";
    if (r->elf.linkage == LINK_MUSL) {
        format(r->message, sizeof r->message,
                 "%s is linked against musl (interpreter %s): the shim is built for and "
                 "qualified on glibc only%s%s%s. %s",
                 t, r->elf.interp,
                 r->loaded ? " (musl's loader did map it here; that is not supported)" : "",
                 !r->loaded && r->loader_message[0] ? "; the loader said: " : "",
                 !r->loaded ? r->loader_message : "", ADVICE);
    } else if (r->loaded) {
        r->exit_code = EXIT_LOADED;
        r->reason = NULL;
        format(r->message, sizeof r->message, "the shim loads into %s (%s, interpreter %s)",
                 t, elf_linkage_name(r->elf.linkage), r->elf.interp[0] ? r->elf.interp : "-");
    } else if (r->elf.linkage == LINK_STATIC) {
        format(r->message, sizeof r->message,
                 "%s is statically linked (no PT_INTERP program header): no dynamic loader "
                 "runs, so nothing reads LD_PRELOAD. %s",
                 t, ADVICE);
    } else if (other_arch) {
        format(r->message, sizeof r->message,
                 "%s is a %d-bit %s program and the shim is %d-bit %s: the loader skips it. "
                 "Use an image for the machine's architecture, or set transport: Direct.",
                 t, r->elf.elf_class == 2 ? 64 : 32, elf_machine_name(r->elf.machine),
                 shim_elf->elf_class == 2 ? 64 : 32, elf_machine_name(shim_elf->machine));
    } else if (r->loader_message[0] != '\0') {
        format(r->message, sizeof r->message, "the dynamic loader of %s refused the shim: %s. %s",
                 t, r->loader_message, ADVICE);
    } else if (r->elf.linkage == LINK_GLIBC) {
        format(r->message, sizeof r->message,
                 "%s is a dynamically linked glibc program but the shim did not load: it may be "
                 "setuid or setgid (secure-execution mode ignores LD_PRELOAD) or clear "
                 "LD_PRELOAD before it execs. Launch through an unprivileged launcher that "
                 "keeps the environment, or set transport: Direct.",
                 t);
    } else {
        format(r->message, sizeof r->message,
                 "%s (%s%s%s) did not load the shim. %s", t, elf_linkage_name(r->elf.linkage),
                 r->elf.interp[0] ? ", interpreter " : "", r->elf.interp, ADVICE);
    }
}

static void json_string(const char *s)
{
    if (s == NULL) {
        fputs("null", stdout);
        return;
    }
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            printf("\\%c", *p);
        else if (*p == '\n')
            fputs("\\n", stdout);
        else if (*p < 0x20 || *p >= 0x7f)
            printf("\\u%04x", *p < 0x20 ? *p : '?');
        else
            putchar(*p);
    }
    putchar('"');
}

static void print_json(const struct report *r)
{
    printf("{\"ok\":%s,\"exitCode\":%d,\"reason\":", r->exit_code == 0 ? "true" : "false",
           r->exit_code);
    json_string(r->reason);
    fputs(",\"launcher\":", stdout);
    json_string(r->launcher);
    fputs(",\"resolved\":", stdout);
    json_string(r->resolved[0] ? r->resolved : NULL);
    fputs(",\"target\":", stdout);
    json_string(r->target[0] ? r->target : NULL);
    fputs(",\"linkage\":", stdout);
    json_string(elf_linkage_name(r->elf.linkage));
    fputs(",\"interpreter\":", stdout);
    json_string(r->elf.interp[0] ? r->elf.interp : NULL);
    fputs(",\"shim\":", stdout);
    json_string(r->shim);
    printf(",\"loaded\":%s,\"markers\":[", r->loaded ? "true" : "false");
    int first = 1;
    for (const char *line = r->markers; *line != '\0';) {
        const char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line) : strlen(line);
        char buf[1024];
        snprintf(buf, sizeof buf, "%.*s", (int)len, line);
        if (!first)
            putchar(',');
        json_string(buf);
        first = 0;
        if (end == NULL)
            break;
        line = end + 1;
    }
    fputs("],\"loaderMessage\":", stdout);
    json_string(r->loader_message[0] ? r->loader_message : NULL);
    fputs(",\"launcherStatus\":", stdout);
    json_string(r->launcher_status[0] ? r->launcher_status : NULL);
    fputs(",\"message\":", stdout);
    json_string(r->message);
    fputs("}\n", stdout);
}

static int finish(struct report *r, int json)
{
    if (json)
        print_json(r);
    else if (r->exit_code == EXIT_LOADED)
        printf("ok: %s\n", r->message);
    else if (r->exit_code == EXIT_NOT_LOADED)
        printf("ShimNotLoaded: %s\n", r->message);
    else
        printf("error: %s\n", r->message);
    fflush(stdout);
    return r->exit_code;
}

static int check_failed(struct report *r, int json, const char *fmt, const char *a, const char *b)
{
    r->exit_code = EXIT_CHECK_FAILED;
    r->reason = "CheckFailed";
    format(r->message, sizeof r->message, fmt, a, b);
    return finish(r, json);
}

int main(int argc, char **argv)
{
    static struct report r;
    int json = 0, timeout_s = 30, i = 1;
    default_shim(r.shim, sizeof r.shim);
    for (; i < argc; i++) {
        if (strcmp(argv[i], "--") == 0) {
            i++;
            break;
        } else if (strcmp(argv[i], "--json") == 0) {
            json = 1;
        } else if (strcmp(argv[i], "--shim") == 0 && i + 1 < argc) {
            snprintf(r.shim, sizeof r.shim, "%s", argv[++i]);
        } else if (strcmp(argv[i], "--timeout") == 0 && i + 1 < argc) {
            char *end = NULL;
            long value = strtol(argv[++i], &end, 10);
            if (*end != '\0' || value < 1 || value > 3600) {
                usage();
                return EXIT_USAGE;
            }
            timeout_s = (int)value;
        } else if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            usage();
            return 0;
        } else if (argv[i][0] == '-') {
            usage();
            return EXIT_USAGE;
        } else {
            break;
        }
    }
    if (i >= argc) {
        usage();
        return EXIT_USAGE;
    }
    r.launcher = argv[i];

    struct elf_info shim_elf;
    char err[512] = "";
    if (access(r.shim, R_OK) != 0 || elf_inspect(r.shim, &shim_elf, err, sizeof err) != 0 ||
        shim_elf.linkage == LINK_NOT_ELF)
        return check_failed(&r, json, "the shim %s is missing or not an ELF library%s", r.shim,
                            "");
    if (resolve(r.launcher, r.resolved, sizeof r.resolved) != 0)
        return check_failed(&r, json, "launcher %s not found or not executable: %s", r.launcher,
                            strerror(errno));
    find_target(&r);
    if (elf_inspect(r.target, &r.elf, err, sizeof err) != 0)
        r.elf.linkage = LINK_UNKNOWN;

    char dir[PATH_MAX];
    const char *tmp = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/nodus-shim-check.XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
    if (mkdtemp(dir) == NULL)
        return check_failed(&r, json, "cannot create a temporary directory %s: %s", dir,
                            strerror(errno));
    char marker[PATH_MAX + 16];
    snprintf(marker, sizeof marker, "%s/marker", dir);
    char **env = child_env(r.shim, marker);
    if (env == NULL) {
        rmdir(dir);
        return check_failed(&r, json, "out of memory%s%s", "", "");
    }
    static char stderr_text[8192];
    pid_t child = 0;
    int ran = run(&r, argv + i, env, timeout_s, stderr_text, sizeof stderr_text, &child);
    if (ran != 0) {
        unlink(marker);
        rmdir(dir);
        return check_failed(&r, json, "cannot run %s: %s", r.resolved, strerror(ran));
    }
    read_markers(&r, marker, (int)child);
    unlink(marker);
    rmdir(dir);
    find_loader_message(&r, stderr_text);
    decide(&r, &shim_elf);
    return finish(&r, json);
}
