"""Fill-in-the-middle prompts from the model's own FIM tokens (docs/openai.md#fill-in-the-middle).

An editor's autocomplete sends the text before the cursor, the text after it and, for llama.cpp's `/infill`,
chunks of other files. The model was trained on one layout (Qwen2.5-Coder's, which is StarCoder's):

    <|repo_name|>{repo}\n<|file_sep|>{file}\n{text} ... <|file_sep|>{file}\n
    <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>

and the answer is the middle. Whether a model can do this is read from its tokenizer: the three FIM markers must
each be one token of its vocabulary (the repository markers are optional: without them extra files are left out).
The prompt is then an ordinary text prompt, so speculation and the prompt cache apply to it as to any other.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX, SUFFIX, MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
REPO, FILE_SEP, PAD = "<|repo_name|>", "<|file_sep|>", "<|fim_pad|>"
REPO_NAME = "myproject"  # the repository line llama.cpp writes before extra files (the model needs one, any name)


@dataclass
class FimTokens:
    """The FIM markers a tokenizer has as single tokens; `repo` when it also has <|repo_name|> and <|file_sep|>."""

    repo: bool

    @property
    def markers(self) -> list[str]:
        return [PREFIX, SUFFIX, MIDDLE, PAD] + ([REPO, FILE_SEP] if self.repo else [])


def _one_token(tok, text: str) -> bool:
    try:
        ids = tok(text, add_special_tokens=False)["input_ids"]
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode it has no such token
        return False
    return len(ids) == 1 and ids[0] != getattr(tok, "unk_token_id", None)


def fim_tokens(tok) -> FimTokens | None:
    """The model's FIM support, from its tokenizer (None: it has no FIM tokens, and FIM requests get a 400)."""
    if tok is None or not all(_one_token(tok, m) for m in (PREFIX, SUFFIX, MIDDLE)):
        return None
    return FimTokens(repo=_one_token(tok, REPO) and _one_token(tok, FILE_SEP))


def stop_markers(fim: FimTokens) -> list[str]:
    """Where a middle ends besides the end-of-sequence token: the model padding, or starting a file or repository
    (llama.cpp ends infill at these too). Sent as stop words: the model stops at the token itself."""
    return [PAD] + ([FILE_SEP, REPO] if fim.repo else [])


def contains_marker(text: str, fim: FimTokens) -> str | None:
    """The first FIM marker `text` spells out, if any: it would be read as the token and change the layout."""
    return next((m for m in fim.markers if m in text), None)


def fim_prompt(fim: FimTokens, prefix: str, suffix: str, extra: list[tuple[str, str]] | None = None) -> str:
    """The model's FIM layout. With `extra` (a list, empty too: llama.cpp's `/infill`) and the repository
    markers, llama.cpp's preamble comes first: the repository line, each extra file under its name, and a
    placeholder line for the file being edited; then prefix, suffix, middle."""
    head = ""
    if extra is not None and fim.repo:
        head = f"{REPO}{REPO_NAME}\n" + "".join(f"{FILE_SEP}{name}\n{text}" for name, text in extra)
        head += f"{FILE_SEP}filename\n"
    return f"{head}{PREFIX}{prefix}{SUFFIX}{suffix}{MIDDLE}"
