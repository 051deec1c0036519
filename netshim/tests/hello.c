/* The smallest launcher: nodus-shim-check is run on it built with glibc, statically, and
 * with musl (dynamically and statically). */
#include <stdio.h>

int main(void)
{
    puts("hello");
    return 0;
}
