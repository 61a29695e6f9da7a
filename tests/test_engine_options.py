"""Every engine option has one default: the same in `EngineConfig`, in `LLM(...)`'s keywords and in the
server's flags, all as `serving.core.engine_args` declares it; and each one is a flag and an `LLM` keyword."""

import dataclasses
import inspect
import os
import re
import typing

import pytest
from absl import flags

from serving import LLM, EngineConfig
from serving import server
from serving.core import engine_args
from serving.core.engine_args import OPTIONS


@pytest.fixture(scope="module")
def flag_values():
    fv = flags.FlagValues()  # a fresh set: the global FLAGS stay untouched
    server.define_flags(fv)
    return fv


def _ids(options):
    return [o.name for o in options]


def test_engine_config_fields_are_the_engine_options_in_order():
    fields = dataclasses.fields(EngineConfig)
    assert [f.name for f in fields] == _ids(engine_args.ENGINE_CONFIG_OPTIONS)
    assert {o.name for o in OPTIONS if not o.engine_config} == {
        "generation_config", "tensor_parallel_size", "pipeline_parallel_size", "num_microbatches",
        "compilation_cache_dir", "lora_modules", "logits_processors", "runner", "pooler_config"}
    assert dataclasses.fields(EngineConfig) and EngineConfig.__dataclass_params__.frozen


@pytest.mark.parametrize("option", engine_args.ENGINE_CONFIG_OPTIONS, ids=_ids(engine_args.ENGINE_CONFIG_OPTIONS))
def test_engine_config_default(option):
    field = {f.name: f for f in dataclasses.fields(EngineConfig)}[option.name]
    assert field.default == option.default and type(field.default) is type(option.default)
    assert getattr(EngineConfig(), option.name) == option.default


@pytest.mark.parametrize("option", OPTIONS, ids=_ids(OPTIONS))
def test_llm_keyword_default(option):
    param = inspect.signature(LLM.__init__).parameters.get(option.name)
    assert param is not None, f"{option.name} is not a keyword of LLM()"
    assert param.kind is inspect.Parameter.KEYWORD_ONLY
    assert param.default == option.default and type(param.default) is type(option.default)


@pytest.mark.parametrize("option", OPTIONS, ids=_ids(OPTIONS))
def test_server_flag_default_type_and_help(flag_values, option):
    assert option.name in flag_values, f"--{option.name} is not a server flag"
    flag = flag_values[option.name]
    assert flag.default == option.default and type(flag.default) is type(option.default)
    assert flag.help.endswith(option.help)  # an enum's help starts with its <choices>
    if option.choices is not None:
        assert list(flag.parser.enum_values) == list(option.choices)
    # The flag parses values of the option's type (absl's parser for int / float / bool / str / enum).
    if option.default is not None:
        assert flag.parser.parse(str(option.default).lower() if option.base_type is bool else str(option.default)) \
            == option.default


def test_engine_flags_are_listed_as_the_servers_own(flag_values):
    """`python -m serving.server --help` shows a program's own flags: the engine options count as the server's."""
    own = {f.name for f in flag_values.get_key_flags_for_module(server.__name__)}
    assert set(_ids(OPTIONS)) <= own and "port" in own


def test_declarations_are_well_formed():
    names = _ids(OPTIONS)
    assert len(names) == len(set(names))
    for o in OPTIONS:
        assert o.help and o.help[0].isupper() and o.help.endswith((".", ")")), o.name
        assert o.base_type in (int, float, bool, str), o.name
        optional = type(None) in typing.get_args(o.type)
        assert o.default is None if optional else isinstance(o.default, o.base_type), o.name
        if o.choices is not None:
            assert o.default is None or o.default in o.choices, o.name
    assert "measured" in engine_args.BY_NAME["min_token_bucket"].help.lower()


def test_flags_pass_through_to_llm(flag_values, monkeypatch):
    """make_llm_from_flags hands every option's parsed value to LLM(...), nothing hard-coded in between."""
    argv = ["server", "--min_token_bucket=8", "--noenable_prefix_caching", "--kv_cache_dtype=int8",
            "--speculative_method=ngram", "--num_speculative_tokens=3", "--kv_cache_memory_fraction=0.5",
            "--compilation_cache_dir=", "--checkpoint=/nowhere"]
    fv = flags.FlagValues()
    server.define_flags(fv)
    fv(argv)
    seen = {}

    class FakeLLM:
        def __init__(self, checkpoint, **kw):
            seen.update(kw, checkpoint=checkpoint)

    monkeypatch.setattr("serving.llm.LLM", FakeLLM)
    server.make_llm_from_flags(fv)
    want = {o.name: o.default for o in OPTIONS}
    want.update(min_token_bucket=8, enable_prefix_caching=False, kv_cache_dtype="int8", speculative_method="ngram",
                num_speculative_tokens=3, kv_cache_memory_fraction=0.5, compilation_cache_dir="")
    assert seen.pop("checkpoint") == "/nowhere" and seen.pop("warmup") == "background"  # the --warmup default
    assert seen == want


def test_unknown_option_and_bad_enum_are_refused(flag_values):
    with pytest.raises(TypeError, match="unexpected keyword argument 'min_token_buckets'"):
        LLM(min_token_buckets=4)
    fv = flags.FlagValues()
    server.define_flags(fv)
    with pytest.raises(flags.IllegalFlagValueError):
        fv(["server", "--weight_dtype=int4"])


def test_naming_an_option_twice_is_refused():
    def __init__(self, *, min_token_bucket: int = 16, **options):
        pass

    with pytest.raises(TypeError, match="min_token_bucket"):
        engine_args.with_option_keywords(__init__)


def test_the_docs_flag_table_lists_every_option_with_its_default():
    """docs/serving.md's table: a row per option, between --max_num_seqs and --compilation_cache_dir; a default
    written as a literal (a number, true / false, `text`) is the declared one."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "docs", "serving.md")).read()
    rows = re.findall(r"^\| `--(\w+)` \| ([^|]*) \|", text, re.M)
    names = [name for name, _ in rows]
    block = names[names.index("max_num_seqs"):names.index("compilation_cache_dir") + 1]
    assert sorted(block) == sorted(_ids(OPTIONS))
    for name, cell in rows:
        if name not in engine_args.BY_NAME:
            continue
        cell, default = cell.strip(), engine_args.BY_NAME[name].default
        if re.fullmatch(r"-?[\d.]+", cell):
            assert float(cell) == default, name
        elif cell in ("true", "false"):
            assert default is (cell == "true"), name
        elif re.fullmatch(r"`[\w.]+`", cell):
            assert cell.strip("`") == default, name
