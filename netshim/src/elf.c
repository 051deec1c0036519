/* Reads just enough of an ELF file to tell how it is linked: the ELF header, then the
 * program headers, looking for PT_INTERP (the dynamic loader the kernel starts). Both
 * classes and both byte orders; every offset is checked against the file's size. */
#include "elf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define PT_INTERP_TYPE 3

static uint64_t get(const unsigned char *p, size_t n, int big_endian)
{
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++)
        v |= (uint64_t)p[big_endian ? n - 1 - i : i] << (8 * i);
    return v;
}

static int read_at(int fd, void *buf, size_t len, uint64_t offset)
{
    size_t done = 0;
    while (done < len) {
        ssize_t n = pread(fd, (char *)buf + done, len - done, (off_t)(offset + done));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        done += (size_t)n;
    }
    return 0;
}

const char *elf_linkage_name(enum elf_linkage linkage)
{
    switch (linkage) {
    case LINK_NOT_ELF: return "not-elf";
    case LINK_STATIC: return "static";
    case LINK_GLIBC: return "glibc";
    case LINK_MUSL: return "musl";
    case LINK_OTHER: return "other";
    default: return "unknown";
    }
}

const char *elf_machine_name(unsigned machine)
{
    switch (machine) {
    case 3: return "i386";
    case 8: return "mips";
    case 20: return "ppc";
    case 21: return "ppc64";
    case 22: return "s390";
    case 40: return "arm";
    case 62: return "x86_64";
    case 183: return "aarch64";
    case 243: return "riscv";
    default: return "unknown";
    }
}

static enum elf_linkage classify(const char *interp)
{
    const char *base = strrchr(interp, '/');
    base = base ? base + 1 : interp;
    if (strncmp(base, "ld-musl", 7) == 0)
        return LINK_MUSL;
    if (strncmp(base, "ld-linux", 8) == 0 || strncmp(base, "ld64.so", 7) == 0 ||
        strncmp(base, "ld.so", 5) == 0)
        return LINK_GLIBC;
    return LINK_OTHER;
}

int elf_inspect(const char *path, struct elf_info *info, char *err, size_t err_size)
{
    memset(info, 0, sizeof *info);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, err_size, "cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    unsigned char eh[64];
    int result = -1;
    if (fstat(fd, &st) != 0 || read_at(fd, eh, 16, 0) != 0 ||
        memcmp(eh, "\177ELF", 4) != 0) {
        info->linkage = LINK_NOT_ELF;
        result = 0;
        goto out;
    }
    info->elf_class = eh[4];
    info->big_endian = eh[5] == 2;
    int wide = info->elf_class == 2;
    size_t header_size = wide ? 64 : 52;
    if ((info->elf_class != 1 && !wide) || read_at(fd, eh, header_size, 0) != 0) {
        snprintf(err, err_size, "%s: truncated or unknown ELF header", path);
        goto out;
    }
    int be = info->big_endian;
    info->machine = (unsigned)get(eh + 18, 2, be);
    uint64_t phoff = wide ? get(eh + 32, 8, be) : get(eh + 28, 4, be);
    uint64_t phentsize = get(eh + (wide ? 54 : 42), 2, be);
    uint64_t phnum = get(eh + (wide ? 56 : 44), 2, be);
    if (phentsize < (wide ? 56u : 32u) || phnum > 4096 ||
        phoff + phentsize * phnum > (uint64_t)st.st_size) {
        snprintf(err, err_size, "%s: program headers out of bounds", path);
        goto out;
    }
    info->linkage = LINK_STATIC;
    for (uint64_t i = 0; i < phnum; i++) {
        unsigned char ph[56];
        if (read_at(fd, ph, wide ? 56 : 32, phoff + i * phentsize) != 0) {
            snprintf(err, err_size, "%s: cannot read program header %llu", path,
                     (unsigned long long)i);
            goto out;
        }
        if (get(ph, 4, be) != PT_INTERP_TYPE)
            continue;
        uint64_t offset = wide ? get(ph + 8, 8, be) : get(ph + 4, 4, be);
        uint64_t size = wide ? get(ph + 32, 8, be) : get(ph + 16, 4, be);
        if (size == 0 || size >= sizeof info->interp || offset + size > (uint64_t)st.st_size) {
            snprintf(err, err_size, "%s: PT_INTERP out of bounds", path);
            goto out;
        }
        if (read_at(fd, info->interp, size, offset) != 0) {
            snprintf(err, err_size, "%s: cannot read PT_INTERP", path);
            goto out;
        }
        info->interp[size] = '\0';
        info->linkage = classify(info->interp);
        break;
    }
    result = 0;
out:
    close(fd);
    return result;
}

int script_interpreter(const char *path, char *interp, size_t interp_size, char *arg,
                       size_t arg_size)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    char line[512];
    ssize_t n = read(fd, line, sizeof line - 1);
    close(fd);
    if (n < 2 || line[0] != '#' || line[1] != '!')
        return n < 0 ? -1 : 0;
    line[n] = '\0';
    char *end = strchr(line, '\n');
    if (end != NULL)
        *end = '\0';
    /* The kernel's rule: the interpreter, then everything after it as one argument. */
    char *p = line + 2;
    while (*p == ' ' || *p == '\t')
        p++;
    char *q = p;
    while (*q != '\0' && *q != ' ' && *q != '\t')
        q++;
    char *rest = q;
    while (*rest == ' ' || *rest == '\t')
        rest++;
    *q = '\0';
    size_t rest_len = strlen(rest);
    while (rest_len > 0 && (rest[rest_len - 1] == ' ' || rest[rest_len - 1] == '\t' ||
                            rest[rest_len - 1] == '\r'))
        rest[--rest_len] = '\0';
    snprintf(interp, interp_size, "%s", p);
    snprintf(arg, arg_size, "%s", rest);
    return interp[0] != '\0' ? 1 : 0;
}
