/* What nodus-shim-check reads from a launcher's file: shebang lines and ELF headers. */
#ifndef NODUS_NETSHIM_ELF_H
#define NODUS_NETSHIM_ELF_H

#include <stddef.h>

enum elf_linkage {
    LINK_UNKNOWN = 0, /* could not read the file */
    LINK_NOT_ELF,     /* neither ELF nor a #! script */
    LINK_STATIC,      /* ELF without PT_INTERP: no dynamic loader ever runs */
    LINK_GLIBC,       /* PT_INTERP is glibc's ld-linux / ld64 */
    LINK_MUSL,        /* PT_INTERP is ld-musl */
    LINK_OTHER,       /* another dynamic loader (bionic, uClibc, ...) */
};

struct elf_info {
    enum elf_linkage linkage;
    int elf_class;      /* 1 = 32-bit, 2 = 64-bit */
    unsigned machine;   /* e_machine */
    int big_endian;
    char interp[256];   /* PT_INTERP, "" when none */
};

/* Reads path's ELF headers. 0 on success (info->linkage set), -1 with a reason in err. */
int elf_inspect(const char *path, struct elf_info *info, char *err, size_t err_size);

/* If path starts with "#!", the interpreter it names: fills interp (and the first argument,
 * "" if none) and returns 1; 0 when it is not a script; -1 when unreadable. */
int script_interpreter(const char *path, char *interp, size_t interp_size, char *arg,
                       size_t arg_size);

const char *elf_linkage_name(enum elf_linkage linkage);
const char *elf_machine_name(unsigned machine);

#endif
