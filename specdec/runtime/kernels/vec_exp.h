/* e^x for x <= 0, lane by lane, over a GCC vector type: Cephes expf's polynomial (relative error ~1e-7), below -87
 * clamped to e^-87. VEC_EXP_NEG(NAME, VF, VI, ATTR) defines `ATTR VF NAME(VF x)` for float vector VF and the
 * 32-bit integer vector VI of the same lane count (attention.c's copies and small_ops.c). */
#define VEC_EXP_NEG(NAME, VF, VI, ATTR)                                                                           \
    ATTR static inline __attribute__((always_inline)) VF NAME(VF x) {                                          \
        const VF zero = {0}, lo = zero - 87.0f;                                                                \
        const VI below = x < lo; /* all-ones lanes where x < -87 */                                            \
        x = (VF)(((VI)lo & below) | ((VI)x & ~below));                                                         \
        const VF magic = zero + 12582912.0f; /* 1.5 * 2^23: adding and subtracting it rounds to the nearest */ \
        const VF n = (x * 1.44269504088896341f + magic) - magic;                                               \
        x = x - n * 0.693359375f + n * 2.12194440e-4f;                                                         \
        const VF z = x * x;                                                                                    \
        VF p = zero + 1.9875691500E-4f;                                                                        \
        p = p * x + 1.3981999507E-3f;                                                                          \
        p = p * x + 8.3334519073E-3f;                                                                          \
        p = p * x + 4.1665795894E-2f;                                                                          \
        p = p * x + 1.6666665459E-1f;                                                                          \
        p = p * x + 5.0000001201E-1f;                                                                          \
        p = p * z + x + 1.0f;                                                                                  \
        return p * (VF)((__builtin_convertvector(n, VI) + 127) << 23);                                         \
    }
