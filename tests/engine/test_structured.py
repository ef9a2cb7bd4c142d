"""Structured output: the device mask, llguidance's masks on SmolLM2's tokenizer, and the engine
decoding under constraints (SmolLM2's first 4 layers: real tokenizer, weak model, so the
constraint, not the model, makes the output valid)."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

from infer.engine.engine import Engine, EngineConfig
from infer.sampling import SamplingArrays, constrain, draw, sampling_probs, token_keys
from infer.sampling_params import SamplingParams, StructuredOutput
from infer.spec.config import SpeculativeConfig

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "mood": {"enum": ["happy", "sad"]}},
          "required": ["name", "age", "mood"], "additionalProperties": False}
LABEL = r'\{"label": "(positive|negative|neutral)"\}'  # the lesson's classifier regex
CHOICES = ("yes", "no", "maybe so")


def _bitmask(allowed: np.ndarray) -> np.ndarray:
    """Bool [B, V] -> int32 words [B, ceil(V/32)], bit t % 32 of word t // 32 (little-endian
    bits, as llguidance writes them), packed here with numpy only."""
    b, v = allowed.shape
    padded = np.zeros((b, -(-v // 32) * 32), np.uint8)
    padded[:, :v] = allowed
    return np.packbits(padded, axis=-1, bitorder="little").view(np.int32)


# -- the device mask ------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab", [31, 32, 100, 257])
def test_constrain_keeps_exactly_the_allowed_tokens(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    allowed = rng.random((5, vocab)) < rng.random((5, 1))  # densities from ~0 to ~1 per row
    logits = rng.normal(size=(5, vocab)).astype(np.float32)
    out = np.asarray(constrain(jnp.asarray(logits), jnp.asarray(_bitmask(allowed))))
    np.testing.assert_array_equal(out[allowed], logits[allowed])
    assert np.all(np.isneginf(out[~allowed]))


def test_a_one_token_mask_forces_that_token_at_any_temperature() -> None:
    rng = np.random.default_rng(0)
    rows, vocab = 16, 300
    forced = rng.integers(0, vocab, rows)
    allowed = np.zeros((rows, vocab), bool)
    allowed[np.arange(rows), forced] = True
    # The forced token is made the least likely, so nothing but the mask can pick it.
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 3
    logits[np.arange(rows), forced] = -30.0
    params = [SamplingParams(temperature=float(t), top_k=int(k), top_p=float(p), seed=int(s))
              for t, k, p, s in zip(rng.choice([0.0, 0.3, 1.0, 10.0], rows),
                                    rng.choice([0, 1, 5], rows), rng.choice([1.0, 0.5], rows),
                                    rng.integers(0, 2**32, rows))]
    sampling = SamplingArrays.from_params(params, allowed=_bitmask(allowed))
    for step in range(4):
        keys = token_keys(sampling.seeds, jnp.full(rows, step, jnp.int32))
        tokens, _ = draw(jnp.asarray(logits), sampling, keys)
        np.testing.assert_array_equal(np.asarray(tokens), forced)


def test_unconstrained_rows_of_a_masked_batch_draw_as_without_a_mask() -> None:
    rng = np.random.default_rng(1)
    rows, vocab = 8, 200
    logits = jnp.asarray(rng.normal(size=(rows, vocab)).astype(np.float32))
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(rows)]
    keys = token_keys(jnp.arange(rows, dtype=jnp.uint32), jnp.zeros(rows, jnp.int32))
    plain, _ = draw(logits, SamplingArrays.from_params(params), keys)
    everything = np.ones((rows, vocab), bool)
    masked, _ = draw(logits, SamplingArrays.from_params(params, allowed=_bitmask(everything)),
                     keys)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(masked))


def test_a_mask_is_refused_where_drafts_are_verified() -> None:
    sampling = SamplingArrays.from_params([SamplingParams(seed=0)],
                                          allowed=np.full((1, 2), -1, np.int32))
    with pytest.raises(ValueError, match="without speculation"):
        sampling_probs(jnp.zeros((1, 3, 64)), sampling)


def test_a_bitmask_of_the_wrong_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="int32 bitmask"):
        SamplingArrays.from_params([SamplingParams(seed=0)] * 2,
                                   allowed=np.full((1, 2), -1, np.int32))


# -- llguidance's masks on SmolLM2's tokenizer ------------------------------------------------------

@pytest.fixture(scope="module")
def compiler(smollm2):
    from infer.structured import GrammarCompiler
    config, _, tokenizer = smollm2
    return GrammarCompiler(tokenizer, config.vocab_size)


@pytest.mark.parametrize("spec, text", [
    (StructuredOutput(json=SCHEMA), '{"name": "Ada", "age": 36, "mood": "happy"}'),
    (StructuredOutput(regex=LABEL), '{"label": "neutral"}'),
    (StructuredOutput(choice=CHOICES), "maybe so"),
    (StructuredOutput(grammar='start: "(" num ("," num)* ")"\nnum: /[0-9]+/'), "(12,3,456)"),
])
def test_masks_admit_a_valid_text_and_agree_with_the_parser(compiler, smollm2, spec, text
                                                           ) -> None:
    """Along a valid text's tokens, each step's mask holds the next token, and on a random
    sample of the vocabulary it says what the matcher's own token validation says."""
    from infer.structured import mask_words
    _, _, tokenizer = smollm2
    constraint = compiler.constraint(spec)
    reference = compiler.constraint(spec)._matcher  # a second matcher, walked by validation
    rng = np.random.default_rng(len(text))
    vocab = compiler.vocab_size
    for token in tokenizer.encode(text, add_bos=False):
        mask = np.zeros((1, mask_words(vocab)), np.int32)
        constraint.fill(mask, 0)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        assert bits[token], f"token {token} ({tokenizer.decode([token])!r}) masked out"
        for t in rng.choice(vocab, 64, replace=False):
            assert bits[t] == (reference.validate_tokens([int(t)]) == 1), int(t)
        constraint.consume(token)
        assert reference.consume_token(token)
    # Complete: either nothing may follow, or the end-of-sequence token may.
    if not constraint.done:
        mask = np.zeros((1, mask_words(vocab)), np.int32)
        constraint.fill(mask, 0)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        assert all(bits[e] for e in tokenizer.eos_ids)


@pytest.mark.parametrize("spec, message", [
    (dict(regex="(unclosed"), "regex"), (dict(json='{"type": "no-such-type"}'), "type"),
    (dict(grammar="start: undefined_rule"), "undefined_rule")])
def test_an_invalid_constraint_is_refused_when_compiled(compiler, spec, message) -> None:
    with pytest.raises(ValueError, match=message):
        compiler.constraint(StructuredOutput(**spec))


def _admits(compiler, constraint, tokenizer, text: str) -> bool:
    """Whether `constraint` takes `text`'s tokens one by one and then may end."""
    from infer.structured import mask_words
    vocab = compiler.vocab_size
    for token in tokenizer.encode(text, add_bos=False):
        if not constraint.consume(token):
            return False
    if constraint.done:
        return True
    mask = np.zeros((1, mask_words(vocab)), np.int32)
    constraint.fill(mask, 0)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab].astype(bool)
    return any(bits[e] for e in tokenizer.eos_ids)


@pytest.mark.parametrize("seed", range(3))
def test_a_regex_ending_in_a_lone_backslash_is_refused(compiler, smollm2, seed: int) -> None:
    """Random literals followed by 0-5 backslashes: an odd count ends in an incomplete escape,
    which Python's re refuses and llguidance would drop (constraining to the literal alone), so
    it is refused; an even count is that many halved literal backslashes, admitted as such."""
    import random
    import re
    import string

    _, _, tokenizer = smollm2
    rng = random.Random(seed)
    for _ in range(6):
        word = "".join(rng.choices(string.ascii_letters + string.digits + " ", k=rng.randint(0, 6)))
        slashes = rng.randint(0 if word else 1, 5)
        regex = re.escape(word) + "\\" * slashes
        if slashes % 2:
            with pytest.raises(re.error):
                re.compile(regex)
            with pytest.raises(ValueError, match="incomplete escape"):
                compiler.constraint(StructuredOutput(regex=regex))
            continue
        text = word + "\\" * (slashes // 2)
        assert re.fullmatch(regex, text)
        assert _admits(compiler, compiler.constraint(StructuredOutput(regex=regex)), tokenizer,
                       text)
        if slashes:
            assert not _admits(compiler, compiler.constraint(StructuredOutput(regex=regex)),
                               tokenizer, word)


def test_the_boolean_json_schemas(compiler, smollm2) -> None:
    """`true` admits any JSON value (an object or not), `false` none: refused when compiled."""
    _, _, tokenizer = smollm2
    for text in ('[1, "a"]', "3", '{"k": null}'):
        assert _admits(compiler, compiler.constraint(StructuredOutput(json="true")), tokenizer,
                       text)
    assert not _admits(compiler, compiler.constraint(StructuredOutput(json="true")), tokenizer,
                       "[1,")
    with pytest.raises(ValueError, match="false admits no value"):
        compiler.constraint(StructuredOutput(json="false"))


def test_a_token_outside_the_mask_is_refused_not_a_silent_output(compiler, smollm2) -> None:
    _, _, tokenizer = smollm2
    constraint = compiler.constraint(StructuredOutput(choice=CHOICES))
    assert not constraint.consume(tokenizer.encode("zebra", add_bos=False)[0])
    assert constraint.error


@pytest.mark.parametrize("spec", [dict(regex="[a&&b]"), dict(regex=r"[^\s\S]")])
def test_a_constraint_nothing_satisfies_is_refused_when_compiled(compiler, spec) -> None:
    """Its matcher shows it only once the first mask is computed: the request would otherwise
    end at once, 'successfully', with an output outside the language."""
    with pytest.raises(ValueError, match="no output satisfies it"):
        compiler.constraint(StructuredOutput(**spec))


@pytest.mark.parametrize("seed", range(3))
def test_integers_float64_cannot_hold_are_refused(compiler, seed: int) -> None:
    """llguidance reads a schema's numbers as float64: {"const": 1234567890123456789} let
    1234567890123456768 through, and a minimum of 2^53 + 1 admitted 2^53. Such an integer in
    const, enum (nested too) or a numeric bound is refused naming where; up to 2^53 compiles."""
    import random

    rng = random.Random(seed)
    for _ in range(6):
        big = rng.choice([-1, 1]) * rng.randint(2 ** 53 + 1, 2 ** 70)
        exact = rng.choice([-1, 1]) * rng.randint(0, 2 ** 53)
        keyword = rng.choice(["const", "enum", "nested", "minimum", "maximum", "multipleOf"])

        def schema(n: int) -> dict:
            if keyword == "enum":
                return {"enum": ["a", n]}
            if keyword == "nested":
                return {"type": "object", "properties": {"id": {"const": {"k": [n]}}}}
            if keyword == "multipleOf":
                return {"type": "integer", "multipleOf": abs(n) or 1}
            return {"type": "integer", keyword: n} if keyword != "const" else {"const": n}

        refused = abs(big) if keyword == "multipleOf" else big
        with pytest.raises(ValueError, match=f"integer {refused} is beyond"):
            compiler.constraint(StructuredOutput(json=schema(big)))
        if keyword in ("const", "enum", "nested"):
            compiler.constraint(StructuredOutput(json=schema(exact)))
        else:  # llguidance may refuse a bound this long itself, but not for this reason
            try:
                compiler.constraint(StructuredOutput(json=schema(exact)))
            except ValueError as e:
                assert "beyond" not in str(e)


@pytest.mark.parametrize("seed", range(3))
def test_negated_classes_excluding_a_quote_or_backslash_are_refused(compiler, smollm2,
                                                                    seed: int) -> None:
    """A string pattern (or patternProperties key) with a negated class: llguidance lets the
    JSON escapes \\" and \\\\ through it, so "^[^\"]*$" admitted the value a"b. Classes that
    exclude '"' or '\\' (by a literal, a range or \\W) are refused; the others compile and
    admit the escaped characters they allow."""
    import random
    import string

    _, _, tokenizer = smollm2
    rng = random.Random(seed)
    for _ in range(6):
        chars = rng.sample(string.ascii_letters + string.digits + "!#$%&", k=rng.randint(1, 4))
        bad = rng.choice(['"', "\\", "!-#", r"\W", None])
        members = "".join(chars) + ("\\\\" if bad == "\\" else bad or "")
        pattern = f"^[^{members}]*$"
        schema = ({"type": "string", "pattern": pattern} if rng.random() < 0.7 else
                  {"type": "object", "patternProperties": {pattern: {"type": "integer"}},
                   "additionalProperties": False})
        if bad is not None:
            with pytest.raises(ValueError, match="negated character class excluding"):
                compiler.constraint(StructuredOutput(json=schema))
            continue
        text = '"a\\"b\\\\"' if schema.get("type") == "string" else '{"a\\"b\\\\": 1}'
        value = json.loads(text)
        key = value if isinstance(value, str) else next(iter(value))
        admitted = _admits(compiler, compiler.constraint(StructuredOutput(json=schema)),
                           tokenizer, text)
        assert admitted == (re.search(pattern, key) is not None), (pattern, text)


def test_a_schema_json_cannot_encode_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="json must be a JSON schema"):
        StructuredOutput(json={"type": "object", "x": {1, 2}})


# -- the engine -----------------------------------------------------------------------------------

ENGINE = dict(max_num_seqs=4, max_prefill_tokens=32, max_model_len=128, page_size=8)


def _engine(smollm2_4_layers, **overrides) -> Engine:
    _, model, tokenizer = smollm2_4_layers
    return Engine(model, tokenizer, EngineConfig(**{**ENGINE, **overrides}))


def _run(engine: Engine, jobs: list[tuple[str, SamplingParams]]) -> list:
    ids = [engine.add_request(prompt, params) for prompt, params in jobs]
    outputs = {o.request_id: o for o in engine.stream() if o.finished}
    return [outputs[i] for i in ids]


def _check(spec: StructuredOutput, text: str) -> None:
    if spec.json is not None:
        jsonschema.validate(json.loads(text), json.loads(spec.json))
    elif spec.json_object:
        assert isinstance(json.loads(text), dict)
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice


PROMPT = "Describe a person as JSON, then say how the review 'great film!' felt:"
SPECS = [StructuredOutput(json=SCHEMA), StructuredOutput(regex=LABEL),
         StructuredOutput(choice=CHOICES), StructuredOutput(json_object=True)]


@pytest.fixture(scope="module")
def engine(smollm2_4_layers) -> Engine:
    return _engine(smollm2_4_layers)


def test_sampled_outputs_satisfy_their_constraints(engine, compiler) -> None:
    """Temperature 1 on a 4-layer model: only the mask keeps these outputs valid. A draw may
    wander inside a JSON string past max_tokens; such an output must still be a prefix the
    grammar accepts, token by token, under a matcher of its own."""
    seeds = np.random.default_rng().integers(0, 2**31, len(SPECS) * 2)
    jobs = [(PROMPT, SamplingParams(temperature=1.0, seed=int(seed), max_tokens=100,
                                    structured=spec))
            for seed, spec in zip(seeds, SPECS * 2)]
    outputs = _run(engine, jobs)
    for (_, params), out in zip(jobs, outputs):
        if out.finish_reason.value == "stop":
            _check(params.structured, out.text)
            continue
        assert out.finish_reason.value == "length", (seeds, out.finish_reason)
        assert len(out.token_ids) == params.max_tokens
        matcher = compiler.constraint(params.structured)._matcher
        assert all(matcher.consume_token(t) for t in out.token_ids), (seeds, out.text)
    # A mask that never let an output end would pass the loop above on prefixes alone.
    assert sum(o.finish_reason.value == "stop" for o in outputs) > len(outputs) // 2, seeds


def test_constrained_greedy_output_is_the_same_alone_and_in_a_batch(engine) -> None:
    jobs = [(PROMPT, SamplingParams(max_tokens=100, structured=spec)) for spec in SPECS[:3]]
    jobs.append(("Tell me a story", SamplingParams(max_tokens=40)))  # unconstrained batch-mate
    together = _run(engine, jobs)
    for job, out in zip(jobs, together):
        alone, = _run(engine, [job])
        assert alone.token_ids == out.token_ids
        if job[1].structured is not None:
            _check(job[1].structured, out.text)
    # The unconstrained row is what an engine that never saw a constraint gives.
    plain, = _run(engine, [jobs[-1]])
    assert plain.token_ids == together[-1].token_ids


def test_constraints_with_speculation_and_mixed_steps(smollm2_4_layers, engine) -> None:
    """A constrained row drafts nothing (its batch-mate verifies drafts in the same steps,
    the constrained row masked there), and a mixed step masks its rows: the tokens are those
    of the plain engine, constrained and unconstrained alike."""
    jobs = [(PROMPT, SamplingParams(max_tokens=60, structured=SPECS[0])),
            ("Repeat: one two three one two three one two", SamplingParams(max_tokens=30))]
    expected = [o.token_ids for o in _run(engine, jobs)]
    spec = _engine(smollm2_4_layers, speculative=SpeculativeConfig(method="ngram",
                                                                   num_tokens=3))
    assert [o.token_ids for o in _run(spec, jobs)] == expected
    assert spec.speculative_stats()["verify_steps"] > 0
    assert any(s.kind == "verify" and s.constrained for s in spec.runner.ready)
    mixed = _engine(smollm2_4_layers, mixed_steps=True)
    staggered = [jobs[1], (PROMPT + " Be brief.", SamplingParams(max_tokens=60,
                                                                 structured=SPECS[1]))]
    got = _run(mixed, staggered)
    assert any(r.kind == "mixed" for r in mixed.records)
    assert [o.token_ids for o in got] == [o.token_ids for o in _run(engine, staggered)]


def test_a_grammar_that_spells_a_special_token_ends_its_request_not_the_batch(engine) -> None:
    """llguidance's mask allows the special token whose text the choice spells, then refuses it
    (it prefixes special tokens with a byte no text has): that request is aborted, the plain
    one beside it finishes, and the engine is left with nothing unfinished."""
    jobs = [(PROMPT, SamplingParams(max_tokens=8, structured=StructuredOutput(
        choice=("<|im_end|>",)))), (PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))]
    special, plain = _run(engine, jobs)
    assert special.finish_reason.value in ("abort", "stop")
    assert plain.finish_reason.value == "length" and len(plain.token_ids) == 5
    assert not engine.has_unfinished()


def test_a_bad_constraint_is_refused_before_the_engine_changes(engine) -> None:
    before = engine.scheduler.has_unfinished()
    with pytest.raises(ValueError, match="invalid structured output"):
        engine.add_request(PROMPT, SamplingParams(structured=StructuredOutput(regex="(")))
    assert engine.scheduler.has_unfinished() == before


def test_the_plain_loop_refuses_constraints(smollm2_4_layers) -> None:
    from infer.engine.simple_loop import decode_stream
    _, model, tokenizer = smollm2_4_layers
    with pytest.raises(ValueError, match="structured output"):
        next(decode_stream(model, [tokenizer.encode("hi")],
                           [SamplingParams(structured=StructuredOutput(regex="a"))], 4))
