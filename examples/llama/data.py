"""Token batches for LM pre-training: three sources, one loader interface.

Sources (``--data``):

* ``stdlib`` (default, no download): the Python standard library's own ``.py``
  files, found from ``sysconfig.get_paths()["stdlib"]``;
* a path, directory or glob of local text files;
* ``c4``: Hugging Face ``allenai/c4`` ("en"), streamed with ``datasets``
  (``hf_path``/``hf_name``/``hf_data_files`` point it at a local copy in the
  same format: records with a ``text`` column).

Files are split into train and validation by a hash of their path (stable
across runs and machines); C4 uses its own ``validation`` split.

Both loaders yield int32 arrays of shape ``(batch_size, seq_len + 1)`` (inputs
are ``[:, :-1]``, targets ``[:, 1:]``) and expose ``state_dict()`` /
``load_state_dict()``: a small JSON-able dict with which a restored loader
yields exactly the batches the original would have yielded next.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sysconfig
import zlib
from collections.abc import Callable, Iterable, Iterator

import numpy as np

__all__ = [
    "ByteTokenizer",
    "DataSpec",
    "StreamLoader",
    "WindowLoader",
    "get_tokenizer",
    "list_files",
    "make_data",
    "span_windows",
    "split_files",
]


# ---------------------------------------------------------------------------
# Tokenizers.
# ---------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then the specials BOS = 256 and EOS = 257."""

    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer by name or local path (needs ``transformers``, imported lazily)."""

    def __init__(self, name: str):
        try:
            from transformers import AutoTokenizer  # type: ignore[import-not-found]
        except ImportError as e:  # optional dependency
            raise ImportError(f"--tokenizer {name!r} needs `pip install transformers`; the default is 'byte'") from e
        self._tok = AutoTokenizer.from_pretrained(name)
        self.eos_id = self._tok.eos_token_id
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok(text, add_special_tokens=False)["input_ids"], dtype=np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids))


def get_tokenizer(name: str = "byte"):
    """``"byte"`` (no download) or any Hugging Face tokenizer name/path."""
    return ByteTokenizer() if name == "byte" else HFTokenizer(name)


def encode_document(tokenizer, text: str) -> np.ndarray:
    """The document's tokens followed by EOS (the separator in packed rows)."""
    return np.append(tokenizer.encode(text), np.int32(tokenizer.eos_id)).astype(np.int32)


# ---------------------------------------------------------------------------
# Documents.
# ---------------------------------------------------------------------------


def list_files(source: str) -> tuple[str, list[str]]:
    """(root, sorted file paths) of a file source: ``"stdlib"``, a file, a directory or a glob."""
    if source == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        files = [
            f
            for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
            if "site-packages" not in f and "dist-packages" not in f
        ]
    elif os.path.isdir(source):
        root = source
        files = [f for f in glob.glob(os.path.join(source, "**", "*"), recursive=True) if os.path.isfile(f)]
    else:
        files = [f for f in glob.glob(source, recursive=True) if os.path.isfile(f)]
        root = os.path.commonpath(files) if len(files) > 1 else os.path.dirname(files[0]) if files else ""
    if not files:
        raise FileNotFoundError(f"--data {source!r}: no files found")
    return root, sorted(files)


def split_files(root: str, files: list[str], val_fraction: float) -> dict[str, list[str]]:
    """Train/validation split by a CRC32 hash of each file's path relative to `root`.

    Deterministic and independent of the other files: adding a file never
    moves another between splits.
    """
    split: dict[str, list[str]] = {"train": [], "validation": []}
    for f in files:
        h = zlib.crc32(os.path.relpath(f, root).encode()) % 10_000
        split["validation" if h < val_fraction * 10_000 else "train"].append(f)
    return split


def read_text(path: str) -> str:
    with open(path, "rb") as fh:
        return fh.read().decode("utf-8", errors="replace")


def hf_documents(
    path: str, name: str | None, split: str, data_files=None, seed: int = 42
) -> Callable[[int], Iterator[str]]:
    """A function ``skip -> iterator of texts`` over a streamed HF dataset, shuffled with a buffer."""
    import datasets  # type: ignore[import-untyped]  # imported here: only the C4 source needs it

    def docs(skip: int) -> Iterator[str]:
        ds = datasets.load_dataset(path, name, split=split, streaming=True, data_files=data_files)
        if split == "train":
            ds = ds.shuffle(seed=seed, buffer_size=10_000)
        return (ex["text"] for ex in ds.skip(skip))

    return docs


# ---------------------------------------------------------------------------
# Loaders.
# ---------------------------------------------------------------------------


class WindowLoader:
    """Batches of random non-overlapping windows of an in-memory token array.

    The array is cut into ``n = (len - 1) // seq_len`` windows of ``seq_len + 1``
    tokens (consecutive windows share one token); each epoch visits them in a
    permutation seeded by ``(seed, epoch)``, ``batch_size`` at a time (the
    remainder is dropped). The state is the number of batches yielded.

    ``contiguous = k > 1``: each draw is ``k`` consecutive windows (one window of
    ``k * seq_len`` cut in ``k``), ``batch_size / k`` draws a batch. Then a batch
    is exactly the text of the batch of ``batch_size / k`` windows of
    ``k * seq_len`` (same seed), with a ``k`` times shorter context: the
    control that separates the context's length from the number of independent
    places of the text a step samples.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0, contiguous: int = 1):
        if batch_size % contiguous:
            raise ValueError(f"contiguous {contiguous} must divide batch_size {batch_size}")
        self.tokens = np.asarray(tokens)
        self.batch_size, self.seq_len, self.seed, self.contiguous = batch_size, seq_len, seed, contiguous
        self.num_windows = (len(self.tokens) - 1) // (seq_len * contiguous)  # draws of `contiguous` windows
        self.batches_per_epoch = self.num_windows // (batch_size // contiguous)
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{len(self.tokens)} tokens make {self.num_windows} windows of {seq_len * contiguous + 1}: "
                f"fewer than one batch of {batch_size // contiguous}"
            )
        self.position = 0
        self._perm_epoch, self._perm = -1, np.zeros([0], np.int64)  # drawn at each epoch's first batch

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        epoch, i = divmod(self.position, self.batches_per_epoch)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._perm_epoch = epoch
        draws = self.batch_size // self.contiguous
        span = self.seq_len * self.contiguous
        starts = [s * span + j * self.seq_len for s in self._perm[i * draws : (i + 1) * draws]
                  for j in range(self.contiguous)]  # fmt: skip
        self.position += 1
        return np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int32)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


class StreamLoader:
    """Batches packed from a stream of documents, in order, for corpora too big to hold.

    Documents are tokenized (+ EOS) and concatenated; each batch takes the next
    ``batch_size * (seq_len + 1)`` tokens. The state is the number of documents
    consumed and the leftover tokens of the last one; restoring skips that many
    documents of the (deterministically shuffled) stream.
    """

    def __init__(self, documents: Callable[[int], Iterator[str]], tokenizer, batch_size: int, seq_len: int):
        self.documents, self.tokenizer = documents, tokenizer
        self.batch_size, self.seq_len = batch_size, seq_len
        self.docs_consumed, self.carry = 0, np.zeros([0], np.int32)
        self._it: Iterator[str] | None = None

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        if self._it is None:
            self._it = self.documents(self.docs_consumed)
        need = self.batch_size * (self.seq_len + 1)
        parts, have = [self.carry], len(self.carry)
        while have < need:
            doc = encode_document(self.tokenizer, next(self._it))
            self.docs_consumed += 1
            parts.append(doc)
            have += len(doc)
        flat = np.concatenate(parts)
        self.carry = flat[need:]
        return flat[:need].reshape(self.batch_size, self.seq_len + 1).astype(np.int32)

    def state_dict(self) -> dict:
        return {"docs_consumed": self.docs_consumed, "carry": self.carry.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.docs_consumed = int(state["docs_consumed"])
        self.carry = np.asarray(state["carry"], np.int32)
        self._it = None


def span_windows(tokens: np.ndarray, seq_len: int, count: int, span: int) -> np.ndarray:
    """`count` windows of ``seq_len + 1`` tokens cut from evenly spaced spans of ``span + 1`` tokens.

    The ``count * seq_len // span`` spans start where `evenly_spaced_windows` would start
    windows of length `span`; each is cut into ``span // seq_len`` consecutive windows
    (neighbours share one token, as in training). So every `seq_len` that divides `span`
    predicts the same tokens of the same text, ``count * seq_len`` of them, and only the
    context before each one changes: the validation set of a sequence-length study.
    Returns (count, seq_len + 1), the windows of a span in order, spans in order.
    """
    if span % seq_len or (count * seq_len) % span:
        raise ValueError(
            f"val span {span} must be a multiple of seq_len {seq_len} and divide the {count * seq_len} "
            "validation tokens (eval_batches * batch_size * seq_len)"
        )
    spans = evenly_spaced_windows(tokens, span, count * seq_len // span)
    cuts = [spans[:, j * seq_len : (j + 1) * seq_len + 1] for j in range(span // seq_len)]
    return np.stack(cuts, axis=1).reshape(count, seq_len + 1)


def evenly_spaced_windows(tokens: np.ndarray, seq_len: int, count: int) -> np.ndarray:
    """`count` windows of ``seq_len + 1`` tokens spread evenly over `tokens`: (count, seq_len + 1)."""
    last = len(tokens) - seq_len - 1
    if last < 0:
        raise ValueError(f"validation set has {len(tokens)} tokens, fewer than one window of {seq_len + 1}")
    starts = np.linspace(0, last, num=count).astype(np.int64)
    return np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int32)


# ---------------------------------------------------------------------------
# The entry point.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class DataSpec:
    """Where the data comes from and how it is batched.

    Attributes:
      source: ``"stdlib"``, ``"c4"``, or a local file/directory/glob.
      tokenizer: ``"byte"`` or a Hugging Face tokenizer name.
      batch_size, seq_len: each batch is (batch_size, seq_len + 1) tokens.
      seed: the order of training windows/documents.
      val_fraction: files whose path hash falls below it are validation.
      eval_batches: validation batches of (batch_size, seq_len + 1), fixed for the run.
      val_span: 0: the validation windows are ``eval_batches * batch_size`` windows spread
        evenly over the validation text (their text changes with seq_len); N > 0: they are
        cut from evenly spaced spans of N tokens (`span_windows`), the same text and the same
        predicted tokens at every seq_len that divides N (at a fixed batch_size * seq_len).
      contiguous: training windows drawn k consecutive at a time (`WindowLoader`; in-memory
        corpora only).
      hf_path, hf_name, hf_data_files: the dataset for ``source="c4"``.
    """

    source: str = "stdlib"
    tokenizer: str = "byte"
    batch_size: int = 16
    seq_len: int = 256
    seed: int = 0
    val_fraction: float = 0.05
    eval_batches: int = 8
    val_span: int = 0
    contiguous: int = 1
    hf_path: str = "allenai/c4"
    hf_name: str | None = "en"
    hf_data_files: dict | None = None


def make_data(spec: DataSpec):
    """(tokenizer, training loader, validation batches (eval_batches, batch, seq_len + 1))."""
    tokenizer = get_tokenizer(spec.tokenizer)
    n_val_windows = spec.eval_batches * spec.batch_size
    if spec.source == "c4":
        if spec.contiguous != 1:
            raise ValueError("contiguous windows are for in-memory corpora (C4 is packed in order already)")
        train: StreamLoader | WindowLoader = StreamLoader(
            hf_documents(spec.hf_path, spec.hf_name, "train", spec.hf_data_files, seed=42 + spec.seed),
            tokenizer,
            spec.batch_size,
            spec.seq_len,
        )
        val_tokens = _take_tokens(
            hf_documents(spec.hf_path, spec.hf_name, "validation", spec.hf_data_files)(0),
            tokenizer,
            n_val_windows * (spec.seq_len + 1) if not spec.val_span else n_val_windows * spec.seq_len + 1,
        )
    else:
        root, files = list_files(spec.source)
        split = split_files(root, files, spec.val_fraction)
        if split["train"] and split["validation"]:
            train_tokens = _concat(tokenizer, split["train"])
            val_tokens = _concat(tokenizer, split["validation"])
        else:  # too few files to split by file: hold out the tail of the text
            tokens = _concat(tokenizer, files)
            cut = int(len(tokens) * (1 - spec.val_fraction))
            train_tokens, val_tokens = tokens[:cut], tokens[cut:]
        train = WindowLoader(train_tokens, spec.batch_size, spec.seq_len, spec.seed, spec.contiguous)
    if spec.val_span:
        val = span_windows(val_tokens, spec.seq_len, n_val_windows, spec.val_span)
    else:
        val = evenly_spaced_windows(val_tokens, spec.seq_len, n_val_windows)
    return tokenizer, train, val.reshape(spec.eval_batches, spec.batch_size, spec.seq_len + 1)


def _concat(tokenizer, files: list[str]) -> np.ndarray:
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32
    return np.concatenate([encode_document(tokenizer, read_text(f)).astype(dtype) for f in files])


def _take_tokens(docs: Iterator[str], tokenizer, count: int) -> np.ndarray:
    parts, have = [], 0
    for text in docs:
        parts.append(encode_document(tokenizer, text))
        have += len(parts[-1])
        if have >= count:
            break
    return np.concatenate(parts) if parts else np.zeros([0], np.int32)
