"""Every Unicode code point, in seven contexts, through ds2's converted tokenizer and tiktoken.

Too slow for the suite (about 160 s on one core); run it by hand after touching the pattern or the
conversion, or on another version of `tokenizers` (its Oniguruma has its own Unicode tables):

    PYTHONPATH=$PWD:$PWD/tests python tests/support/tiktoken_every_code_point.py

It prints the number of texts whose ids differ (0 with tokenizers 0.23.3 / tiktoken 0.14.0) and
the first code points that do.
"""
import sys, time, unicodedata
import tiktoken
from support.make_moonlight_tokenizer import ranks_from_bpe, crossing_merges, CROSSING_RANKS
from ds2cli.text import tiktoken_convert as tc
ranks = crossing_merges(ranks_from_bpe(), CROSSING_RANKS)
backend = tc.build(ranks, {})
enc = tiktoken.Encoding("x", pat_str=tc.MOONSHOT_PATTERN, mergeable_ranks=ranks, special_tokens={})
cps = [c for c in range(0x110000) if unicodedata.category(chr(c)) not in ("Cs",)]
print(sys.version.split()[0], unicodedata.unidata_version, len(cps))
ctx = ["a{}b", " {}1", "{}{}", "A{}'S", "中{}x", "\n{} ", "{}  x"]
texts = []
for i in range(0, len(cps), 32):
    chunk = [chr(c) for c in cps[i:i + 32]]
    texts.append("".join(k.format(c, c) if k.count("{}") == 2 else k.format(c) for c in chunk for k in ctx))
t = time.time()
ours = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
ref = enc.encode_ordinary_batch(texts)
bad = [i for i in range(len(texts)) if ours[i] != ref[i]]
print("texts", len(texts), "mismatching", len(bad), f"{time.time()-t:.1f}s")
for i in bad[:10]:
    # find the char
    for c in cps[i*32:(i+1)*32]:
        s = "".join(k.format(chr(c), chr(c)) if k.count("{}") == 2 else k.format(chr(c)) for k in ctx)
        if backend.encode(s, add_special_tokens=False).ids != enc.encode_ordinary(s):
            print(hex(c), unicodedata.category(chr(c)), unicodedata.name(chr(c), "?"))
