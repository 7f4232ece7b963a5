"""A small word-level tokenizer for the Countdown prompt and responses.

The tiny CPU policy cannot use a hub tokenizer (no downloads), so the project builds its
own: one token per fixed piece of the prompt template (the text between its `{numbers}` and
`{target}` slots, as a BPE trained on this corpus would merge it), per word (with its leading
space), per digit, per operator or punctuation mark, and one each for the four tags. A prompt
is then about 20 tokens instead of about 120, which is most of the tiny policy's compute. Digits stay single tokens so the model
sees numbers digit by digit, which is what makes arithmetic learnable at this size.
The result is a `PreTrainedTokenizerFast`, saved and loaded with the same
`save_pretrained` / `AutoTokenizer.from_pretrained` calls a hub model uses.
"""

from __future__ import annotations

import re
import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
TAGS = ("<think>", "</think>", "<answer>", "</answer>")
# A token is a tag, a word, a digit or a symbol, each optionally with one leading space,
# or a bare whitespace character. Order matters: tags before symbols.
PIECE_PATTERN = r" ?</?answer>| ?</?think>| ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]|\s"
SYMBOLS = "+-*/()=,.[]:;?!'\"<>_"




def corpus_symbols(texts: list[str]) -> str:
    """SYMBOLS plus every other ASCII punctuation mark the texts use (task=math: LaTeX's backslash and braces)."""
    used = set().union(*map(set, texts)) & set(string.punctuation)
    return SYMBOLS + "".join(sorted(used - set(SYMBOLS)))


def template_pieces(template: str) -> list[str]:
    """The fixed text of a prompt template around its slots (`{numbers}` and `{target}`; `{problem}`), with
    doubled braces read as the single braces the formatted prompt holds."""
    pieces, current = [], ""
    for literal, slot, *_ in string.Formatter().parse(template):
        current += literal  # a doubled brace splits the literal text: join it back
        if slot is not None:
            pieces.append(current)
            current = ""
    return [piece for piece in (*pieces, current) if piece]


def countdown_vocabulary(corpus_texts: list[str], phrases: list[str] = (), symbols: str = SYMBOLS) -> list[str]:
    """The token list: specials, whole phrases, tags, digits, symbols, whitespace, then every corpus word."""
    pieces = [PAD, EOS, UNK, *phrases]
    for base in (*TAGS, *"0123456789", *symbols):
        pieces += [base, " " + base]
    pieces += [" ", "\n", "\t"]
    words = set()
    for text in corpus_texts:
        for word in re.findall(r"[A-Za-z]+", text):
            words.update((word, " " + word))
    pieces += sorted(words - set(pieces))
    return list(dict.fromkeys(pieces))


def build_countdown_tokenizer(corpus_texts: list[str], phrases: list[str] = (),
                              symbols: str = SYMBOLS) -> PreTrainedTokenizerFast:
    """Build the word-level tokenizer covering `corpus_texts`, with each of `phrases` as one token and each of
    `symbols` (task=math: `corpus_symbols`, LaTeX's backslash and braces among them)."""
    vocab = {piece: index for index, piece in enumerate(countdown_vocabulary(corpus_texts, phrases, symbols))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Longest phrases first, so a phrase that contains another still matches whole.
    phrase_pattern = "".join(re.escape(phrase) + "|" for phrase in sorted(phrases, key=len, reverse=True))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(phrase_pattern + PIECE_PATTERN), behavior="isolated")
    # Pieces carry their own whitespace, so decoding is plain concatenation.
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )
    return tokenizer
