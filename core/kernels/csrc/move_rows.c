// KV cache compaction after a verified tree, for every layer's key and value buffer in one call:
// in each buffer and each head, row src[i] moves to row dst[i]. The engine keeps the accepted
// path (src = committed + path[i], ascending) in slots dst = committed + i <= src, so moving
// in order of i never overwrites a row still to be read.
#include <stdint.h>
#include <string.h>

// ctypes: move_rows(ptr bases, i32 nbuf, i64 heads, i64 head_stride, i64 row_bytes, ptr src, ptr dst,
//                   i32 n) -> void
void move_rows(const int64_t *bases, int nbuf, int64_t heads, int64_t head_stride, int64_t row_bytes,
               const int64_t *src, const int64_t *dst, int n) {
    for (int b = 0; b < nbuf; b++)
        for (int64_t h = 0; h < heads; h++) {
            char *base = (char *)bases[b] + h * head_stride;
            for (int i = 0; i < n; i++)
                if (src[i] != dst[i]) memmove(base + dst[i] * row_bytes, base + src[i] * row_bytes, row_bytes);
        }
}
