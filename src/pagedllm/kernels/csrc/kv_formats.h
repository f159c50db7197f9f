// The quantized cache's formats as the kernels number them: BlockCodec.code, the index into
// attention/quant.py's CODEC_KINDS (quant_attention and quant_write read the same numbers).
#pragma once

#include <cstdint>

namespace pagedllm_kv {

enum Kind : int64_t { INT8 = 0, INT4_CHANNEL = 1, INT4_TOKEN = 2, FP8_E4M3 = 3, FP8_E5M2 = 4 };

}  // namespace pagedllm_kv
