"""Weight formats: one class a format, each in its module with its kernels, behind the interface
model/linear.py states (matmul, product and span for the executor, rows, dequantize, nbytes,
the spec files and inspect show). A format of your own is a `base.QuantMatrix` subclass with
`@register`: files, recipes, the loader and inspect find it by its name.

Bottom-up:
    base       QuantMatrix (what every low-bit format shares), the registry, dequantize
    float32    Dense: float32 values, one BLAS call
    q8         int8 with one scale a row (applied to the output)
    bfloat16   bfloat16 values: q8's kernels, no scales
    q8b        int8 with a scale a block of 32 inputs (GGUF's Q8_0), stored in transposed panels
    q4         4-bit with a bfloat16 scale a group of 32 rows of a column
"""

from ds2cli.weights.formats.base import FORMATS, QuantError, QuantMatrix, bfloat16_dtype, dequantize, register
from ds2cli.weights.formats.float32 import Dense, as_weight
from ds2cli.weights.formats.q8 import Q8
from ds2cli.weights.formats.bfloat16 import BFloat16
from ds2cli.weights.formats.q8b import Q8b, panel_width, to_panels
from ds2cli.weights.formats.q4 import Q4, Q4_GROUP

Format = QuantMatrix    # a format is its class

__all__ = ["bfloat16_dtype", "FORMATS", "QuantError", "QuantMatrix", "Format", "dequantize", "register", "Dense", "as_weight",
           "Q8", "BFloat16", "Q8b", "Q4", "Q4_GROUP", "panel_width", "to_panels"]



def __getattr__(name: str):
    if name == "BF16":              # bfloat16_dtype(), imported when first read (base.bfloat16)
        return bfloat16_dtype()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


for _name in ("q8", "q4", "q8b", "bf16"):     # the order files and reports list them in
    FORMATS[_name] = FORMATS.pop(_name)
