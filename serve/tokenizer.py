"""Text for models without a tokenizer: a synthetic word tokenizer.

Built-in models (``tiny-gpt2``, ``gpt2``, ...) are random weights from a config,
so no real tokenizer comes with them and none can be downloaded. Their text is
a word vocabulary instead: token id ``i`` is the word ``t<i>`` (the config's EOS
id is ``<eos>``), words are split on whitespace, and decoding joins words with a
space. Any id the model produces has a text; a client that generates prompts
from a tokenizer (``vllm bench serve --dataset-name random``) gets the same ids
back after a round trip when given the saved tokenizer (:func:`save_synthetic_tokenizer`).
A word outside the vocabulary encodes to ``<unk>`` (id ``vocab_size``, outside
the model), which the server refuses naming the word.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SYNTHETIC = "synthetic"
EOS, UNK = "<eos>", "<unk>"


def synthetic_tokenizer(vocab_size: int, eos_token_id: int | None = None) -> Any:
    """A ``transformers`` fast tokenizer whose word ``t<i>`` is token ``i``.

    Args:
        vocab_size: the model's vocabulary size (ids ``0 .. vocab_size-1``).
        eos_token_id: the model's EOS id (its word is ``<eos>``), or None.

    Returns:
        A ``PreTrainedTokenizerFast`` with ``eos_token`` (if given) and
        ``unk_token`` (id ``vocab_size``) as special tokens, marked
        ``is_synthetic = True``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size) if i != eos_token_id}
    if eos_token_id is not None:
        vocab[EOS] = eos_token_id
    vocab[UNK] = vocab_size
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS if eos_token_id is not None else None,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.is_synthetic = True
    return tokenizer


def save_synthetic_tokenizer(path: str | Path, vocab_size: int, eos_token_id: int | None) -> Path:
    """Write the synthetic tokenizer to ``path`` (``save_pretrained``) for clients
    such as ``vllm bench serve --tokenizer PATH``; returns ``path``."""
    path = Path(path)
    synthetic_tokenizer(vocab_size, eos_token_id).save_pretrained(path)
    return path


def load_tokenizer(name: str | None, model_tokenizer: Any, config: Any) -> Any:
    """The tokenizer ``rose-serve`` uses.

    Args:
        name: ``--tokenizer``: a local directory, ``synthetic``, or None (the
            model directory's tokenizer, else the synthetic one).
        model_tokenizer: the tokenizer found next to the model, or None.
        config: the model's config (``vocab_size``, ``eos_token_id``).

    Raises:
        ValueError: if ``name`` is neither ``synthetic`` nor a directory holding
            a tokenizer.
    """
    if name is None and model_tokenizer is not None:
        return model_tokenizer
    if name is None or name == SYNTHETIC:
        eos = getattr(config, "eos_token_id", None)
        return synthetic_tokenizer(int(config.vocab_size), eos if isinstance(eos, int) else None)
    if not Path(name).is_dir():
        raise ValueError(
            f"--tokenizer {name!r} is not a directory; give a local directory saved with "
            "transformers (save_pretrained), or 'synthetic' (downloads are not possible)"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"--tokenizer {name!r} holds no readable tokenizer: {err}") from None
