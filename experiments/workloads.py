"""The experiments' workloads, written once: Poisson arrivals with Pareto output lengths, prompts
cut from real text (CPython's pydoc topics, `common.real_text`) and the held-out splits.

The text is split by characters: [0, TRAIN_CHARS) is where draft training data comes from
(`spec_data`), everything from HELD_OUT on is text no draft was trained on (the speculation
prompts, the KV-format evaluation). Training sequences are split by `split_heldout`.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

TRAIN_CHARS = 300_000  # real_text[:TRAIN_CHARS] is draft training text
HELD_OUT = 360_000  # real_text from here on was never trained on

GROUNDED = (
    "Summarize the following text.\n\n{text}",
    "Rewrite the following text in plain, simple words.\n\n{text}",
    "Repeat the following text exactly, but change its first sentence:\n\n{text}",
)
CHAT = (
    "Explain the following in simple terms.\n\n{text}",
    "What is this text about? Answer in a few sentences.\n\n{text}",
    "What are the benefits of regular exercise?",
    "Write a short story about a robot who learns to paint.",
    "How do I make a good cup of tea?",
    "Give me three tips for learning a new language.",
    "Why is the sky blue?",
    "Describe a typical day of a software engineer.",
)
# The repetitive kind: one instruction over many records of the same shape, so that answers
# repeat their template across requests (what suffix decoding's corpus of finished outputs
# drafts from) while their values come from each request's own prompt.
RECORD_TEMPLATES = (
    ('Extract the record as JSON with the keys "name", "age", "job", "employer", "city", '
     '"country" and "email".\n\nRecord: {first} {last}, {age}, is {job} at {employer} in '
     '{city}, {country}. {pronoun} email is {email}.'),
    ('Describe the product as JSON with the keys "product", "brand", "price", "color", "size" '
     'and "in_stock".\n\nProduct: the {brand} {product}, {color}, size {size}, sold for '
     '${price}; {stock} units are in stock.'),
)
FIRST = (("Maria", "Her"), ("Tom", "His"), ("Aiko", "Her"), ("Samuel", "His"), ("Priya", "Her"),
         ("Lena", "Her"), ("Omar", "His"), ("Grace", "Her"), ("Ivan", "His"), ("Chen", "His"))
LAST = ("Lopez", "Becker", "Tanaka", "Okafor", "Sharma", "Novak", "Haddad", "Kim", "Petrov", "Wu")
JOBS = (("a nurse", "Saint Anne Hospital"), ("a baker", "Sunrise Bakery"),
        ("a teacher", "Hillside School"), ("an engineer", "Northwind Labs"),
        ("a pilot", "Blue Sky Airlines"), ("a chef", "The Green Table"))
PLACES = (("Madrid", "Spain"), ("Hamburg", "Germany"), ("Osaka", "Japan"), ("Lagos", "Nigeria"),
          ("Pune", "India"), ("Prague", "Czechia"), ("Toronto", "Canada"))
PRODUCTS = ("running shoe", "rain jacket", "backpack", "desk lamp", "coffee mug", "wool scarf")
BRANDS = ("Acme", "Nordic", "Orion", "Vela", "Kestrel")
COLORS = ("red", "navy blue", "black", "green", "white")
INSTRUCTIONS = (  # of the chat-formatted training prompts
    "Summarize the following text.",
    "Explain the following in simple terms.",
    "Continue the following text.",
    "What is this text about?",
    "Rewrite the following more clearly.",
    "Give a short Python example related to this text.",
    "List the key points of this text.",
    "Explain:",
    "Summarize:",
    "Continue:",
)


# -- requests: arrivals and lengths ----------------------------------------------------------

def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """Arrival times of a Poisson process of `rate` per unit time (float [n], increasing; the
    first after one gap); rate inf: all at 0."""
    if not rate > 0:  # NaN too: NaN arrivals are never reached by a loop that waits for them
        raise ValueError(f"rate must be > 0 (arrivals per second), got {rate}")
    return np.cumsum(rng.exponential(1.0 / rate, n))


def pareto_lengths(rng: np.random.Generator, n: int, shape: float, scale: float, cap: int, *,
                   round_up: bool = False) -> np.ndarray:
    """Lengths Pareto(shape, scale) (the classical form: at least `scale`), rounded down (or up)
    to whole tokens and capped at `cap` (int [n])."""
    # numpy's pareto() is the Lomax form; 1 + it, times the scale, is the classical Pareto.
    x = scale * (1.0 + rng.pareto(shape, n))
    return np.minimum(np.ceil(x) if round_up else np.floor(x), cap).astype(int)


def prompt_lengths(rng: np.random.Generator, n: int, lo: int, hi: int, dist: str = "uniform",
                   median: float | None = None, sigma: float | None = None) -> np.ndarray:
    """Prompt lengths in [lo, hi]: uniform, or lognormal (of `median`, `sigma` of the log)
    clipped to the range (int [n])."""
    if dist == "uniform":
        return rng.integers(lo, hi + 1, n)
    if dist == "lognormal":
        return np.clip(np.rint(rng.lognormal(np.log(median), sigma, n)), lo, hi).astype(int)
    raise ValueError(f"unknown prompt_dist {dist!r}: uniform or lognormal")


def poisson_pareto(rng: np.random.Generator, *, num_requests: int, rate: float,
                   prompt_min: int, prompt_max: int, output_shape: float, output_scale: float,
                   output_cap: int, prompt_dist: str = "uniform",
                   prompt_median: float | None = None, prompt_sigma: float | None = None,
                   max_model_len: int | None = None, round_up: bool = False
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(arrivals, prompt lengths, output lengths) of `num_requests` requests: Poisson arrivals,
    prompt lengths as `prompt_lengths`, output lengths as `pareto_lengths`, drawn in that order
    from `rng`. With `max_model_len`, every request fits it with at least one output token."""
    # Refused, not drawn: numpy rejects some of these deep inside, and the clamps below would
    # quietly turn the others into one-token outputs or prompt_min-token prompts.
    if output_cap < 1:
        raise ValueError(f"output_cap must be >= 1 (tokens), got {output_cap}")
    if not output_shape > 0 or not output_scale > 0:
        raise ValueError(f"output_shape and output_scale must be > 0 (Pareto), got "
                         f"{output_shape}, {output_scale}")
    if prompt_dist == "lognormal" and not (prompt_median is not None and prompt_median > 0
                                           and prompt_sigma is not None and prompt_sigma >= 0):
        raise ValueError(f"a lognormal prompt needs prompt_median > 0 and prompt_sigma >= 0, "
                         f"got {prompt_median}, {prompt_sigma}")
    arrivals = poisson_arrivals(rng, num_requests, rate)
    prompts = prompt_lengths(rng, num_requests, prompt_min, prompt_max, prompt_dist,
                             prompt_median, prompt_sigma)
    outputs = pareto_lengths(rng, num_requests, output_shape, output_scale, output_cap,
                             round_up=round_up)
    if max_model_len is not None:
        prompts = np.clip(prompts, prompt_min, min(prompt_max, max_model_len - 1)).astype(int)
        outputs = np.maximum(1, np.minimum(outputs, max_model_len - prompts))
    return arrivals, prompts, outputs


# -- prompts ---------------------------------------------------------------------------------

def text_ids(tokenizer: Any, chars: int, offset: int = 0) -> list[int]:
    """Token ids of `chars` characters of the real text from `offset`."""
    from experiments.common import real_text

    return tokenizer.encode(real_text(chars, offset=offset))


def consecutive_prompts(ids: Sequence[int], count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens, one after another from the start of `ids`."""
    return [list(ids[i * length:(i + 1) * length]) for i in range(count)]


def held_out_paragraphs(count: int, min_chars: int = 200, max_chars: int = 500,
                        skip: int = 0) -> list[str]:
    """Prose paragraphs (no tables or code listings) of the held-out text, in order, the first
    `skip` left out; each cut to `max_chars` at a sentence end where possible."""
    from pydoc_data.topics import topics

    from experiments.common import real_text

    total = len("\n\n".join(topics[k] for k in sorted(topics)))
    text = real_text(total - HELD_OUT, offset=HELD_OUT)
    out = []
    for para in text.split("\n\n"):
        para = " ".join(para.split())
        letters = sum(ch.isalpha() or ch.isspace() for ch in para)
        if len(para) < min_chars or letters < 0.9 * len(para) or "+--" in para:
            continue
        if len(para) > max_chars:
            cut = para[:max_chars]
            para = cut[:cut.rfind(". ") + 1] if ". " in cut else cut
        out.append(para)
    out = out[skip:skip + count]
    if len(out) < count:
        raise ValueError(f"only {len(out)} held-out paragraphs; asked for {count}")
    return out


def record_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` messages of the repetitive kind: the RECORD_TEMPLATES in turn, each over a
    random record (names, jobs, places, products drawn from small lists)."""
    rng = np.random.default_rng(seed)

    def pick(options: Sequence[Any]) -> Any:
        return options[int(rng.integers(len(options)))]

    texts = []
    for i in range(count):
        (first, pronoun), last, (job, employer), (city, country) = (
            pick(FIRST), pick(LAST), pick(JOBS), pick(PLACES))
        texts.append(RECORD_TEMPLATES[i % len(RECORD_TEMPLATES)].format(
            first=first, last=last, age=int(rng.integers(21, 66)), job=job, employer=employer,
            city=city, country=country, pronoun=pronoun,
            email=f"{first.lower()}.{last.lower()}@example.com", brand=pick(BRANDS),
            product=pick(PRODUCTS), color=pick(COLORS), size=pick(("S", "M", "L", "XL")),
            price=f"{int(rng.integers(5, 200))}.{int(rng.integers(0, 100)):02d}",
            stock=int(rng.integers(0, 500))))
    return texts


def build_prompts(tokenizer: Any, kind: str, count: int, max_chars: int) -> list[list[int]]:
    """Chat-formatted prompt token ids: `grounded` (instructions over held-out snippets, for
    n-gram lookup), `chat` (questions, some about other snippets) or `repetitive` (one of two
    extraction instructions over records of one shape: templated answers, `record_prompts`;
    `max_chars` does not apply)."""
    if kind == "repetitive":
        texts = record_prompts(count)
    elif kind == "grounded":
        texts = [GROUNDED[i % len(GROUNDED)].format(text=p)
                 for i, p in enumerate(held_out_paragraphs(count, max_chars=max_chars))]
    elif kind == "chat":
        snippets = held_out_paragraphs(count, max_chars=max_chars, skip=count)
        texts = [CHAT[i % len(CHAT)].format(text=snippets[i]) for i in range(count)]
    else:
        raise ValueError(f"unknown prompt kind {kind!r}")
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}]))
            for t in texts]


def training_prompts(tokenizer: Any, num_sequences: int, prompt_len: int, chat_fraction: float,
                     rng: np.random.Generator) -> tuple[list[list[int]], list[bool]]:
    """Prompt token ids and whether each is chat-formatted (an INSTRUCTION over the snippet,
    through the chat template), from snippets of the training text."""
    from experiments.common import real_text

    text = real_text(TRAIN_CHARS)
    chunk = prompt_len * 8  # characters that surely hold prompt_len tokens
    prompts, chat = [], []
    for _ in range(num_sequences):
        start = int(rng.integers(0, TRAIN_CHARS - chunk))
        space = text.find(" ", start, start + 64)  # start at a word
        start = start if space < 0 else space + 1
        ids = tokenizer.encode(text[start:start + chunk], add_bos=False)[:prompt_len]
        if rng.random() < chat_fraction:
            instruction = INSTRUCTIONS[int(rng.integers(len(INSTRUCTIONS)))]
            message = f"{instruction}\n\n{tokenizer.decode(ids)}"
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": message}])
            prompts.append(tokenizer.encode(rendered, add_bos=False))
            chat.append(True)
        else:
            prompts.append(list(ids))
            chat.append(False)
    return prompts, chat


# -- held-out sequences ----------------------------------------------------------------------

def split_heldout(num_sequences: int, fraction: float = 0.1, seed: int = 0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices): row i is held out by the i-th draw of a fixed stream,
    whatever the number of rows. The data files draw their prompts from one stream
    (`training_prompts`), so row i of a 384-row file is row i of a 1,600-row one; a split by
    each file's size held out rows of one file that a head (`--init`) or a draft vocabulary
    had learned from in another. At least one row is held out (the last, where the stream
    holds none of the first `num_sequences`)."""
    held = np.random.default_rng(seed).random(num_sequences) < fraction
    if num_sequences and not held.any():
        held[-1] = True
    return np.flatnonzero(~held), np.flatnonzero(held)
