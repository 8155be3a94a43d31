"""Fill-in-the-middle: the prompt that asks a DeepSeek-Coder model for the code between a prefix
and a suffix, built from the FIM tokens its tokenizer names.

DeepSeek-Coder (and Coder-V2, whose tokens the V2.5 tokenizer keeps) is trained in PSM order,
as its README's "Code Insertion" example writes it:

    bos <｜fim▁begin｜> PREFIX <｜fim▁hole｜> SUFFIX <｜fim▁end｜>    -> the middle, then eos

Repository-level context (llama-server's `input_extra`: files other than the one being edited)
goes where DeepSeek-Coder's "Repository Level Code Completion" example puts it: the files one
after the other before the current file's text, each opened by a `# path` comment line and
closed by two blank lines. DeepSeek-Coder's training samples are such concatenations of a
repository's files, cut for FIM as one document, so the files sit inside the frame, at the head
of the prefix:

    bos <｜fim▁begin｜> # a.py\\n{a's text}\\n\\n\\n# b.py\\n{b's text}\\n\\n\\n PREFIX <｜fim▁hole｜> SUFFIX
        <｜fim▁end｜>

(a file's text gets a final newline if it lacks one; a file without a path gets no `#` line).
The files and the prefix are encoded as one text, as the model saw them in training; the suffix
is encoded on its own. Both are plain text: a FIM token's text typed in them is the ordinary
tokens of its characters, so only the frame's own tokens open and close the hole.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from ds2cli.errors import Ds2Error, TokenizerError

FIM_BEGIN = "<｜fim▁begin｜>"     # opens the frame; the prefix follows
FIM_HOLE = "<｜fim▁hole｜>"       # where the middle goes; the suffix follows
FIM_END = "<｜fim▁end｜>"         # closes the frame; the model writes the middle after it

MAX_FILES = 256                  # input_extra files in one prompt (an editor sends a few dozen)
MAX_FILE_BYTES = 1 << 20         # their paths and texts together, in UTF-8 bytes
MAX_PATH_CHARS = 1024            # one file's path


class FimUnavailable(TokenizerError):
    """The model's tokenizer lacks the FIM tokens: it was not trained to fill in the middle."""


class RepositoryError(Ds2Error):
    """Repository-level context that is too large or malformed."""


@dataclasses.dataclass(frozen=True)
class FimTokens:
    """The ids of the three FIM tokens in one tokenizer."""
    begin: int
    hole: int
    end: int

    @classmethod
    def of(cls, tokenizer, model_name: str = "the model") -> "FimTokens":
        """Found by their exact text among the tokenizer's added tokens; an error names those missing."""
        ids = {text: tokenizer.added_token_id(text) for text in (FIM_BEGIN, FIM_HOLE, FIM_END)}
        missing = [text for text, i in ids.items() if i is None]
        if missing:
            raise FimUnavailable(f"{model_name}'s tokenizer has no fill-in-the-middle tokens: "
                                 f"{', '.join(missing)} missing (FIM needs a DeepSeek-Coder model, "
                                 f"such as DeepSeek-Coder-V2-Lite)")
        return cls(ids[FIM_BEGIN], ids[FIM_HOLE], ids[FIM_END])

    @property
    def ends(self) -> tuple[int, ...]:
        """Tokens that end a fill as eos does: any of the three opens or closes a frame, which a
        middle never contains."""
        return (self.begin, self.hole, self.end)


def check_files(files: Sequence[tuple[str, str]]) -> None:
    """Repository files (path, text) within MAX_FILES and MAX_FILE_BYTES, each path one line.
    The count is checked before the list is looped over, the bytes as they add up."""
    if len(files) > MAX_FILES:
        raise RepositoryError(f"{len(files)} repository files, more than the limit of {MAX_FILES}")
    total = 0
    for i, (path, text) in enumerate(files):
        if len(path) > MAX_PATH_CHARS or "\n" in path or "\r" in path:
            raise RepositoryError(f"file {i}'s path must be one line of at most {MAX_PATH_CHARS} characters")
        total += len(path.encode("utf-8")) + len(text.encode("utf-8"))
        if total > MAX_FILE_BYTES:
            raise RepositoryError(f"the repository files pass the limit of {MAX_FILE_BYTES} bytes "
                                  f"(at file {i}, {path!r})")


def repository_text(files: Sequence[tuple[str, str]]) -> str:
    """The files as DeepSeek-Coder's repository example lays them out: `# path`, the text, two blank lines."""
    check_files(files)
    out = []
    for path, text in files:
        head = f"# {path}\n" if path else ""
        out.append(head + (text if text.endswith("\n") else text + "\n") + "\n\n")
    return "".join(out)


def fim_text(prefix: str, suffix: str, files: Sequence[tuple[str, str]] = ()) -> tuple[str, str]:
    """(the text before the hole, the text after it), without the frame's tokens."""
    return repository_text(files) + prefix, suffix


def fim_ids(tokenizer, tokens: FimTokens, prefix: str, suffix: str,
            files: Sequence[tuple[str, str]] = ()) -> list[int]:
    """bos <｜fim▁begin｜> files + prefix <｜fim▁hole｜> suffix <｜fim▁end｜> as ids (bos when the
    tokenizer adds one)."""
    before, after = fim_text(prefix, suffix, files)
    bos = [tokenizer.bos_token_id] if tokenizer.adds_bos else []
    plain = dict(add_special_tokens=False, parse_special=False)   # a typed <｜fim▁hole｜> is text
    return [*bos, tokens.begin, *tokenizer.encode(before, **plain), tokens.hole,
            *tokenizer.encode(after, **plain), tokens.end]
