"""The package's settings: every environment variable megatron-rl-patches reads, in one table
(`SETTINGS`: its name, what it means for --help and `doctor`, and its parser), the syntax of their
values (one parser each), and the one place outside the start-up machinery (`patching/`) and the apps
where the environment is read (`# ---- reading`; the test kit's child processes take theirs from here too).

Every variable is read through its parser by whoever reads it: `read_settings` is how the launcher
(`run`), the start-up hook and `doctor` read them all (one verdict each: the same meaning, or the same
refusal naming the variable: tests/patching/test_one_verdict.py), and a door's reader (`shared_prefix`,
`backend`, ...) calls the same parser. A setting is read once, at the door of whoever uses it (an op's
public call, a framework's patch entry, a client's constructor), into a typed value passed down as an
argument: nothing below a door reads the environment. To add a setting (docs/design.md, "Where to add
... a setting"): its name, its parser in `# ---- values` (a function of its text, None when unset,
raising ValueError naming the variable) and its row in `SETTINGS`, one reader in `# ---- reading`
(`environ`: a mapping to read instead of the process's, for `doctor` and the tests), and the door's
call. tests/apps/cli/test_variable_table.py holds every name the package, the docs and --help write
to this table; tests/test_settings_reads.py holds every read of the environment to this module.

Standard library only and cheap: the start-up hook imports it in every Python process."""
from __future__ import annotations

import os

TYPE_CHECKING = False  # not typing's: this module runs at start-up (see patching/env.py)
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence

PREFIX = "MEGATRON_RL_PATCHES"
SELECT = PREFIX
DISABLE = f"{PREFIX}_DISABLE"
STRICT = f"{PREFIX}_STRICT"
INFERENCE_ROLES = f"{PREFIX}_INFERENCE_ROLES"
ALLOW_UNTESTED = f"{PREFIX}_ALLOW_UNTESTED"
BACKEND = f"{PREFIX}_BACKEND"
INVARIANT = f"{PREFIX}_INVARIANT"
NATIVE = f"{PREFIX}_NATIVE"
OPD_PREFIX = f"{PREFIX}_OPD_"  # slime_opd's variables
OPD_TEACHERS = f"{OPD_PREFIX}TEACHERS"
OPD_WEIGHTS = f"{OPD_PREFIX}WEIGHTS"
OPD_K = f"{OPD_PREFIX}K"
OPD_DIVERGENCE = f"{OPD_PREFIX}DIVERGENCE"
OPD_COEF = f"{OPD_PREFIX}COEF"
OPD_POLICY_WEIGHT = f"{OPD_PREFIX}POLICY_WEIGHT"
OPD_RESIDENCY = f"{OPD_PREFIX}RESIDENCY"
OPD_IDS_FROM = f"{OPD_PREFIX}IDS_FROM"
OPD_SCORE_AT = f"{OPD_PREFIX}SCORE_AT"
VERL_ROWS = f"{PREFIX}_VERL_ROWS"
SHARED_PREFIX = f"{PREFIX}_SHARED_PREFIX"
VERL_TEACHER = f"{PREFIX}_VERL_TEACHER"
TEACHER_API_KEY = f"{PREFIX}_TEACHER_API_KEY"  # a served teacher's key (teachers.ServedTeacher)
LAUNCHER_ROOT = f"{PREFIX}_LAUNCHER_ROOT"  # set by `run` for its children, never by hand

OPD_VARIABLES = (OPD_TEACHERS, OPD_WEIGHTS, OPD_K, OPD_DIVERGENCE, OPD_COEF, OPD_POLICY_WEIGHT, OPD_RESIDENCY,
                 OPD_IDS_FROM, OPD_SCORE_AT)
# Launchers' rank variables (torchrun, slurm, Open MPI, MPICH): read where torch.distributed is not
# initialized yet, e.g. at interpreter start-up.
RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")

# ---- values: the syntax of a setting's text, one parser each: `SETTINGS` below names each variable's, and
# the launcher, `doctor`, the start-up hook and the doors read every variable through it (`read_settings`)

_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_SWITCH = {**dict.fromkeys(_ON, True), **dict.fromkeys(_OFF, False), "": None}
ON_WORDS, OFF_WORDS = "/".join(_ON), "/".join(_OFF)  # what a switch's refusal lists: every word it takes
_DIGITS = frozenset("0123456789")
_LONGEST = 4000  # int() refuses longer digit strings (sys.int_info.default_max_str_digits): not a size anyway


def cut(text: str, limit: int = 40) -> str:
    """`text`, shortened to `limit` characters with '...' (a pasted megabyte must not flood stderr)."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def ascii_int(text: str) -> int | None:
    """`text` as an int when it is one or more ASCII digits 0-9 and nothing else (no sign, space, '_'
    or another script's digits); None otherwise, for the caller's error naming its setting.
    `str.isdigit()` takes '²' (which `int()` then refuses with a bare "invalid literal"), and `int()`
    takes '٣', '３', '1_0' and '+2': a size written so would be misread or escape as an error naming
    nothing."""
    if not text or len(text) > _LONGEST or not set(text) <= _DIGITS:
        return None
    return int(text)


def _switch(name: str, text: str | None, on: str, off: str) -> bool | None:
    """A switch's text read: True, False, or None when unset or ""; ValueError naming the variable and
    every word it takes (`on` / `off`: what each side does) for any other text."""
    word = (text or "").strip().lower()
    if word not in _SWITCH:
        raise ValueError(f"{name}={(text or '')[:40]!r} is not a switch: use {ON_WORDS} ({on}) or {OFF_WORDS} ({off}), "
                         "or leave it unset")
    return _SWITCH[word]


def strict_setting(text: str | None) -> bool:
    """MEGATRON_RL_PATCHES_STRICT's value read: True for a switch on, else False."""
    return _switch(STRICT, text, "patch problems raise", "they warn") is True


def allow_untested_setting(text: str | None) -> bool:
    """MEGATRON_RL_PATCHES_ALLOW_UNTESTED's value read: True for a switch on, else False."""
    return _switch(ALLOW_UNTESTED, text, "apply patches outside their supported range", "skip them there") is True


def invariant_setting(text: str | None) -> bool | None:
    """MEGATRON_RL_PATCHES_INVARIANT's value read: True, False, or None when unset or ""."""
    return _switch(INVARIANT, text, "invariant vocabulary ops", "the default mode")


def native_setting(text: str | None) -> bool:
    """MEGATRON_RL_PATCHES_NATIVE's value read: False for a switch off, else True (unset or "" included)."""
    return _switch(NATIVE, text, "the compiled kernel", "the torch tiles") is not False


def shared_prefix_setting(text: str | None) -> bool:
    """MEGATRON_RL_PATCHES_SHARED_PREFIX's value read: True for a switch on, False when off, unset or ""."""
    return _switch(SHARED_PREFIX, text, "pack by shared prefix", "each sample whole") is True


def verl_rows_setting(text: str | None) -> bool:
    """MEGATRON_RL_PATCHES_VERL_ROWS's value read: True for "all" (any case), False when unset or "";
    ValueError naming the variable for any other text."""
    word = (text or "").strip().lower()
    if word not in ("all", ""):
        raise ValueError(f"{VERL_ROWS}={(text or '')[:40]!r} is not a row choice: use all (every row), or leave it "
                         "unset for the rows verl reads")
    return word == "all"


def secret_setting(text: str | None) -> bool:
    """A secret's value read as whether it is set (never its text: a key goes nowhere but its request)."""
    return bool(text)


AUTO = "auto"
BUILTIN_BACKENDS = ("torch", "triton", "gemm")  # the backends that always exist; others register by name at run time


def parse_backend(value: str | None, known: Iterable[str] = BUILTIN_BACKENDS) -> str:
    """MEGATRON_RL_PATCHES_BACKEND's value read, trimmed and lower-cased: "auto" for None, "" or "auto";
    ValueError naming the variable and the accepted words for anything else."""
    word = (value or "").strip().lower()
    names = tuple(known)
    if not word or word == AUTO:
        return AUTO
    if word in names:
        return word
    raise ValueError(f"{BACKEND}={cut(value or '')!r} is not a backend: use {' or '.join(names)} (any case), "
                     f"or {AUTO}, \"\" or unset to let each op choose")


# MEGATRON_RL_PATCHES: which patches start-up applies. Off: unset or one of _SELECT_OFF; every patch: one of
# _SELECT_ALL (any case); else comma-separated names (which exist is the registry's: `patching.env.selection`).
EVERY = "all"
_SELECT_OFF = frozenset(("", "0", "false", "no", "off", "none"))
_SELECT_ALL = frozenset(("1", EVERY, "true", "yes", "on"))


def split_names(value: str | Sequence[str] | None) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']; a sequence is taken as already split."""
    if value is None:
        return []
    if not isinstance(value, str):
        if not isinstance(value, (list, tuple, set, frozenset)):
            raise TypeError(f"patch names must be a string or a list of strings, got {value!r}")
        bad = [item for item in value if not isinstance(item, str)]
        if bad:
            raise TypeError(f"patch names must be strings, got {bad!r}; pass e.g. ['ddp_hooks']")
    items = value.split(",") if isinstance(value, str) else list(value)
    return [item.strip() for item in items if item and item.strip()]


def selection_enabled(text: str | None) -> bool:
    """Whether MEGATRON_RL_PATCHES's text asks for patching at start-up (not unset nor an off word);
    never raises: the start-up hook asks it first, in every process."""
    return (text or "").strip().lower() not in _SELECT_OFF


def selection_setting(text: str | None) -> str | tuple[str, ...] | None:
    """MEGATRON_RL_PATCHES's value read: None when off, EVERY ("all") for every patch, else the names it
    lists, in order; ValueError naming the variable when it is on yet names no patch (' , ')."""
    if not selection_enabled(text):
        return None
    word = (text or "").strip()
    if word.lower() in _SELECT_ALL:
        return EVERY
    names = split_names(word)
    if not names:
        raise ValueError(f"{SELECT}={cut(text or '')!r} names no patch: use all, or comma-separated patch names "
                         "(`megatron-rl-patches list` shows them)")
    return tuple(names)


def disabled_setting(text: str | None) -> tuple[str, ...]:
    """MEGATRON_RL_PATCHES_DISABLE's value read: the names it lists ((): unset or ""); ValueError naming the
    variable for a text that names none (' , ')."""
    names = split_names(text)
    if (text or "").strip() and not names:
        raise ValueError(f"{DISABLE}={cut(text or '')!r} names no patch: list patch names to leave out, or unset it")
    return tuple(names)


# The residency modes a frozen build may name, for every room: the builds, the `memory --residency`
# planner, the roles variable and slime's OPD variable.
RESIDENCY_MODES = ("resident", "swap", "stream")


def check_residency(value: object, what: str = "residency") -> str:
    """`value` when it names a residency mode; a ValueError naming `what` and the modes otherwise."""
    if value not in RESIDENCY_MODES:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, RESIDENCY_MODES))}, got {value!r}")
    return str(value)


# A teacher's (or a role's) own parallel layout as a setting writes it: the `;tp=N` / `;pp=N` options of
# a MEGATRON_RL_PATCHES_OPD_TEACHERS entry or a MEGATRON_RL_PATCHES_INFERENCE_ROLES role (also `;ep=N`, of
# which only 1 is served yet). The world's size is checked where the teacher is built
# (`inference.teacher_layout.layout.check_world`).
LAYOUT_SIZES = ("tp", "pp", "ep")
_KINDS = {"tp": "tensor", "pp": "pipeline", "ep": "expert"}
_UNSERVED = ("ep",)


def is_layout_option(option: str) -> bool:
    """Whether `option` (one `;`-separated piece, stripped) names a teacher layout size."""
    return option.partition("=")[0].strip() in LAYOUT_SIZES and "=" in option


def layout_size(option: str, where: str) -> tuple[str, int]:
    """(name, size) of a `tp=N` / `pp=N` / `ep=N` option; ValueError naming `where` (the setting
    and its entry) for a value that is not a positive integer, or an expert size > 1."""
    name, _, raw = option.partition("=")
    name, raw = name.strip(), raw.strip()
    size = ascii_int(raw) or 0
    if size < 1:
        raise ValueError(f"{where}: option '{name}={raw[:40]}' must be a positive integer written in ASCII digits "
                         f"(the teacher's own {_KINDS[name]}-parallel size, e.g. ';{name}=2')")
    if name in _UNSERVED and size > 1:
        raise ValueError(f"{where}: option '{name}={size}': a teacher's own {_KINDS[name]}-parallel size is not "
                         "served yet (tensor and pipeline parallelism are: ';tp=N;pp=M'); drop it or use 1")
    return name, size


def written_sizes(tp: int | None, pp: int | None) -> str:
    """The layout options as an entry writes them: 'tp=2', 'pp=2' or 'tp=2;pp=2'."""
    return ";".join(f"{name}={size}" for name, size in (("tp", tp), ("pp", pp)) if size is not None)


# MEGATRON_RL_PATCHES_INFERENCE_ROLES: comma-separated `role`, `role:residency`, `role;tp=N` entries.


def _role_entries(text: str | None) -> list[tuple[str, str | None]]:
    """Each entry as (role, its residency lower-cased: None when it names none, "" for 'role:')."""
    entries = []
    for item in split_names(text):
        name, colon, mode = item.split(";")[0].partition(":")
        entries.append((name.strip(), mode.strip().lower() if colon else None))
    return entries


def role_names_of(text: str | None) -> list[str] | None:
    """The role names the text lists ('' means none); None when unset (the integration that reads it has
    its default roles)."""
    return None if text is None else [name for name, _ in _role_entries(text)]


def role_residencies_of(text: str | None) -> dict[str, str]:
    """Residency per role from entries `role:residency` (e.g. 'judge:stream,ref:swap'); roles listed
    without one are absent (resident)."""
    return {name: mode for name, mode in _role_entries(text) if mode is not None}


def role_layouts_of(text: str | None) -> dict[str, int]:
    """The role's own tensor-parallel size per role from entries `role;tp=N` or `role:MODE;tp=N`; each
    option checked (ValueError naming the variable)."""
    layouts: dict[str, int] = {}
    for item in split_names(text):
        name, *options = item.split(";")
        where = f"{INFERENCE_ROLES} role {cut(item)!r}"
        sizes: dict[str, int] = {}
        for written in (option.strip() for option in options):
            if not is_layout_option(written):
                raise ValueError(f"{where}: unknown option {cut(written)!r}; the option is ';tp=N' (the role's "
                                 "model at its own tensor-parallel size, e.g. judge;tp=2)")
            size, value = layout_size(written, where)
            if size in sizes:
                raise ValueError(f"{where}: option {size!r} given twice; give each option once")
            sizes[size] = value
        if sizes.get("pp", 1) > 1:  # a role at its own layout is built and scored at its own tp only
            raise ValueError(f"{where}: option 'pp={sizes['pp']}': a role's model at its own pipeline-parallel "
                             "size is not served yet (a role at its own layout takes ';tp=N'; an own pipeline is "
                             "served for MEGATRON_RL_PATCHES_OPD_TEACHERS entries 'PATH;pp=N'); drop it or use 1")
        if "tp" in sizes:
            layouts[name.partition(":")[0].strip()] = sizes["tp"]
    return layouts


def roles_setting(text: str | None) -> tuple[str, ...] | None:
    """MEGATRON_RL_PATCHES_INFERENCE_ROLES's value read: the roles it lists (() for ""), None when unset;
    ValueError naming the variable for a value that names no role, a name that is not an identifier, a
    role twice, a layout option or residency it does not take. Syntax only: which roles exist is the
    framework's business."""
    roles = role_names_of(text)
    shown = cut(text or "")
    if text and not roles:
        raise ValueError(f"{INFERENCE_ROLES}={shown!r} names no role: list role names (comma-separated), "
                         f"set it to \"\" for none, or unset it for the default")
    bad = [role for role in roles or () if not role.isidentifier()]
    if bad:
        raise ValueError(f"{INFERENCE_ROLES}={shown!r}: {cut(bad[0])!r} is not a role name; role names "
                         f"are identifiers (letters, digits, '_'), comma-separated")
    twice = [role for index, role in enumerate(roles or ()) if role in (roles or ())[:index]]
    if twice:
        raise ValueError(f"{INFERENCE_ROLES}={shown!r} lists role {cut(twice[0])!r} more than once; "
                         "list each role once (role, or role:residency)")
    role_layouts_of(text)
    wrong = [(role, mode) for role, mode in role_residencies_of(text).items() if mode not in RESIDENCY_MODES]
    if wrong:
        raise ValueError(f"{INFERENCE_ROLES}={shown!r}: role {cut(wrong[0][0])!r} has residency "
                         f"{cut(wrong[0][1])!r}; use role:{'|'.join(RESIDENCY_MODES)} (e.g. ref:stream), or the "
                         "role alone for resident")
    return None if roles is None else tuple(roles)


# ---- the table: every variable a user sets, what it means (--help's epilog, `doctor`) and its parser


class Setting:
    """One variable: what it means and its parser. The parser is a function of the variable's text
    (None when unset) or, for a framework's variables, "module:function" resolved only where the variable
    is set (this module stays standard-library only and start-up light): a function of its text, or,
    `together`, of the whole environment mapping (top-k OPD's variables are read as one: their checks span
    variables; its refusal names the variable at fault)."""

    __slots__ = ("meaning", "parse", "together")

    def __init__(self, meaning: str, parse: Callable[..., object] | str, together: bool = False) -> None:
        self.meaning, self.parse, self.together = meaning, parse, together


_OPD = "megatron_rl_patches.integrations.megatron.opd.opd_settings:opd_settings"
_SCORE_AT = "megatron_rl_patches.integrations.megatron.opd.opd_settings:score_at"
_VERL_TEACHER = "megatron_rl_patches.integrations.verl.entry:read_teacher"

SETTINGS: dict[str, Setting] = {
    SELECT: Setting(
        '"all" (or "1") or comma-separated patch names: applied in every Python process at start-up; '
        'unset, "" or "0": off', selection_setting),
    DISABLE: Setting(
        "comma-separated patch names removed from any selection", disabled_setting),
    STRICT: Setting(
        '1/true/yes/on: patch problems raise instead of warning (0/false/no/off/"": warn)', strict_setting),
    # slime's default roles: integrations.slime.roles.DEFAULT_INFERENCE_ROLES (a test holds them equal)
    INFERENCE_ROLES: Setting(
        "comma-separated roles built inference-only, each once (unset: slime's teacher roles "
        'prm_teacher,teacher; "": none); role:mode keeps its weights off the device, mode resident, '
        "swap or stream (e.g. teacher:swap,prm_teacher:stream); role;tp=N (or role:mode;tp=N) "
        "builds the role's model at its own tensor-parallel size (quote the ';')", roles_setting),
    ALLOW_UNTESTED: Setting(
        "1: apply patches outside their supported megatron-core range (one warning each)", allow_untested_setting),
    BACKEND: Setting(
        "the vocabulary ops' tile backend: torch, triton or gemm (any case); unset, \"\" or \"auto\": each op "
        "picks the first backend that runs on its tensors' device (triton on CUDA when installed, else "
        "torch); an op's backend= argument wins", parse_backend),
    INVARIANT: Setting(
        "1/true/yes/on: the vocabulary ops run in the invariant mode (each row's values from that row "
        "and the weights alone, bit for bit, whatever the batch and the layout; "
        "docs/train-rollout-agreement.md); 0/false/no/off: the default mode; unset or \"\": an op's "
        "invariant= argument, else the model config's batch_invariant_mode", invariant_setting),
    NATIVE: Setting(
        "0/false/no/off: the invariant mode's CPU sums run on the torch tiles; unset, \"\" or 1/true/yes/on: "
        "on a C kernel built at first use with $CC (else cc or gcc; cached under $XDG_CACHE_HOME or ~/.cache), "
        "the torch tiles where no compiler builds it. Every rank of a tensor-parallel group must run the same "
        "(their bits differ)", native_setting),
    OPD_TEACHERS: Setting(
        "slime_opd: comma-separated teachers, PATH (a checkpoint of the actor's architecture, or a "
        "Hugging Face directory of another supported family: built by build_inference_model_from_hf) or "
        "PATH@module:function; a Hugging Face directory at its own layout: PATH;tp=N and/or "
        "PATH;pp=N (its own tensor / pipeline-parallel sizes over all ranks); a Hugging Face "
        "directory with another tokenizer than the student's: PATH;tokenizer=own, optionally "
        "followed by ;stop_tokens=module:function (a student special id -> the teacher's id or "
        "None); a teacher served by vLLM: http(s)://host:port;engine=vllm (;tokenizer=DIR for another "
        "tokenizer; no user:pass@ in the URL: the key goes in MEGATRON_RL_PATCHES_TEACHER_API_KEY); quote "
        "the ';'; read by slime's training actors and, for ;context=KEY entries and "
        "MEGATRON_RL_PATCHES_OPD_SCORE_AT=rollout, by its rollout manager: set it in the job's runtime_env "
        "(it reaches both; --train-env-vars reaches the training actors only)", _OPD, together=True),
    OPD_WEIGHTS: Setting(
        "slime_opd: mixture weights, one per teacher, summing to 1 (unset: uniform)", _OPD, together=True),
    OPD_K: Setting(
        "slime_opd: the student's top-k ids per token (default 16), or vocab (the divergence over the whole "
        "vocabulary from the teachers' hidden states)", _OPD, together=True),
    OPD_DIVERGENCE: Setting(
        "slime_opd: reverse_kl (default), forward_kl, jsd, skew_forward_kl, skew_reverse_kl, tv or "
        "mixed_kl", _OPD, together=True),
    OPD_COEF: Setting(
        "slime_opd: weight of the top-k divergence (default 1.0)", _OPD, together=True),
    OPD_POLICY_WEIGHT: Setting(
        "slime_opd: weight of slime's policy loss (default 1.0)", _OPD, together=True),
    OPD_RESIDENCY: Setting(
        "slime_opd: resident (default), swap or stream, for the separate teachers "
        "(PATH@module:function, Hugging Face folders of another architecture)", _OPD, together=True),
    OPD_IDS_FROM: Setting(
        "slime_opd: student (default), union (the student's and the first teacher's top-k) or teacher "
        "(the first teacher's own top-k)", _OPD, together=True),
    OPD_SCORE_AT: Setting(
        "slime_opd: where a served teacher of the student's tokenizer (top-k route) is asked: train "
        "(default: by the train step) or rollout (each sample as its generation ends; its rows carried "
        "with the sample to the training ranks); read by slime's rollout manager only: set it in the job's "
        "runtime_env, beside MEGATRON_RL_PATCHES_OPD_TEACHERS (--train-env-vars does not reach the rollout "
        "manager; with no teachers there it warns once and the train step asks)", _SCORE_AT, together=True),
    VERL_ROWS: Setting(
        "verl_fused_logprobs: all computes every row, not only the rows verl reads", verl_rows_setting),
    SHARED_PREFIX: Setting(
        "1/true/yes/on: slime's passes (training, old and reference log-probs, in-process teachers, the "
        "live self-teacher), verl's engine passes (patch verl_fused_logprobs) and NeMo-RL's Megatron passes "
        "(patch nemo_rl_shared_prefix) pack each micro-batch by shared prefix: samples sharing leading tokens (a "
        "group's prompt, a privileged context) compute them once, exactly; a pass that cannot packs each "
        "sample whole with one warning (an error under MEGATRON_RL_PATCHES_STRICT=1; docs/shared-prefix.md); "
        "0/false/no/off, unset or \"\": each sample packed whole", shared_prefix_setting),
    VERL_TEACHER: Setting(
        "verl_topk_kd: a teacher served by vLLM answering verl's teacher-loop client, "
        "http(s)://host:port;engine=vllm (its --max-logprobs at least verl's topk), or a pooling "
        "server with ;head=DIR (any K; on verl's fused route the whole-vocabulary KL); unset: verl's own "
        "teacher replicas; set in the agent-loop and trainer workers' environment", _VERL_TEACHER),
    TEACHER_API_KEY: Setting(
        "the API key sent to a teacher served by an inference engine (teachers.ServedTeacher), "
        "as a bearer token; never part of a URL or an entry", secret_setting),
}
VARIABLES = tuple(SETTINGS)  # set by users
MEANINGS = {name: setting.meaning for name, setting in SETTINGS.items()}
READ = (*VARIABLES, LAUNCHER_ROOT)  # every variable the package reads

# ---- reading: the environment, read here only (each reader at call time: a door calls it once)


def environment(environ: Mapping[str, str] | None = None) -> Mapping[str, str]:
    """`environ`, or this process's environment; TypeError for what is no mapping."""
    if environ is None:
        return os.environ
    if not callable(getattr(environ, "get", None)):
        raise TypeError(
            f"environ must be a mapping of variable names to strings (like os.environ), got {type(environ).__name__}"
        )
    return environ


def text(environ: Mapping[str, str] | None, name: str) -> str | None:
    """The variable's text (None when unset); TypeError naming it when a mapping holds a non-string."""
    value = environment(environ).get(name)
    if value is not None and not isinstance(value, str):
        raise TypeError(f"environ[{name!r}] must be a string (environment values are), got "
                        f"{type(value).__name__} {cut(repr(value))}")
    return value


class Readings:
    """Every variable read through the table: `values` (name -> what it means; None where refused) and
    `refusals` (name -> the refusal's text, naming the variable), in the table's order."""

    __slots__ = ("values", "refusals")

    def __init__(self) -> None:
        self.values: dict[str, object] = {}
        self.refusals: dict[str, str] = {}


def read_settings(environ: Mapping[str, str] | None = None, names: Iterable[str] = ()) -> Readings:
    """The variables `names` (default: every one a user sets) read through their parsers (`SETTINGS`), as
    the launcher, `doctor` and the start-up hook read them: one verdict each, whoever reads."""
    env = environment(environ)
    readings, together = Readings(), {}
    for name in tuple(names) or VARIABLES:
        setting, raw = SETTINGS[name], text(env, name)
        try:
            if isinstance(setting.parse, str) and not setting.together:
                readings.values[name] = None if raw is None else _resolved(setting.parse)(raw)
            elif isinstance(setting.parse, str):  # read once for its whole group, where one of it is set
                group = [other for other, each in SETTINGS.items() if each.parse == setting.parse]
                if setting.parse not in together:
                    together[setting.parse] = _group_reading(setting.parse, env, group)
                value, refusal = together[setting.parse]
                readings.values[name] = None if raw is None else value
                if refusal is not None and _named(refusal, group, env) == name:
                    raise refusal
            else:
                readings.values[name] = setting.parse(raw)
        except ValueError as exc:
            readings.values[name] = None
            readings.refusals[name] = str(exc)
    return readings


def _resolved(reference: str) -> Callable[..., object]:
    """The function "module:function" names (a framework's parser: imported only where it is needed)."""
    import importlib  # lazy: import cost: only where a framework's variable is set

    module, _, function = reference.partition(":")
    parse: Callable[..., object] = getattr(importlib.import_module(module), function)
    return parse


def _group_reading(reference: str, env: Mapping[str, str], group: list[str]) -> tuple[object, ValueError | None]:
    """(what the group's parser reads, None) or (None, its refusal); nothing read where none of it is set."""
    if all(text(env, name) is None for name in group):
        return None, None
    try:
        return _resolved(reference)(env), None
    except ValueError as exc:
        return None, exc


def _named(refusal: ValueError, group: list[str], env: Mapping[str, str]) -> str:
    """The variable a group's refusal is about: the one its text names first (one outside the group, as
    top-k OPD's refusal of MEGATRON_RL_PATCHES_OPD_SCORE_AT: that variable's own parser says it), else the
    group's first one set."""
    import re  # lazy: import cost: only on a refusal

    found = [(match.start(), name) for name in VARIABLES
             for match in re.finditer(rf"{re.escape(name)}(?!\w)", str(refusal))]
    if found:
        return min(found)[1]
    return next(name for name in group if text(env, name) is not None)


def strict(environ: Mapping[str, str] | None = None) -> bool:
    """MEGATRON_RL_PATCHES_STRICT (`strict_setting`): patch problems raise instead of warning."""
    return strict_setting(text(environ, STRICT))


def allow_untested(environ: Mapping[str, str] | None = None) -> bool:
    """MEGATRON_RL_PATCHES_ALLOW_UNTESTED (`allow_untested_setting`): apply patches outside their range."""
    return allow_untested_setting(text(environ, ALLOW_UNTESTED))


def selection(environ: Mapping[str, str] | None = None) -> str | tuple[str, ...] | None:
    """MEGATRON_RL_PATCHES (`selection_setting`)."""
    return selection_setting(text(environ, SELECT))


def disabled(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """MEGATRON_RL_PATCHES_DISABLE (`disabled_setting`)."""
    return disabled_setting(text(environ, DISABLE))


def inference_roles(environ: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """MEGATRON_RL_PATCHES_INFERENCE_ROLES, checked (`roles_setting`)."""
    return roles_setting(text(environ, INFERENCE_ROLES))


def invariant(environ: Mapping[str, str] | None = None) -> bool | None:
    """MEGATRON_RL_PATCHES_INVARIANT: True, False, or None when unset or "" (`invariant_setting`)."""
    return invariant_setting(text(environ, INVARIANT))


def backend(environ: Mapping[str, str] | None = None, known: Iterable[str] = BUILTIN_BACKENDS) -> str:
    """MEGATRON_RL_PATCHES_BACKEND (`parse_backend`): a backend's name, or "auto" (each op chooses)."""
    return parse_backend(text(environ, BACKEND), known)


def native(environ: Mapping[str, str] | None = None) -> bool:
    """MEGATRON_RL_PATCHES_NATIVE (`native_setting`)."""
    return native_setting(text(environ, NATIVE))


def verl_rows(environ: Mapping[str, str] | None = None) -> bool:
    """MEGATRON_RL_PATCHES_VERL_ROWS (`verl_rows_setting`)."""
    return verl_rows_setting(text(environ, VERL_ROWS))


def shared_prefix(environ: Mapping[str, str] | None = None) -> bool:
    """MEGATRON_RL_PATCHES_SHARED_PREFIX (`shared_prefix_setting`); slime's door reads it once."""
    return shared_prefix_setting(text(environ, SHARED_PREFIX))


def verl_teacher(environ: Mapping[str, str] | None = None) -> str:
    """MEGATRON_RL_PATCHES_VERL_TEACHER as written, trimmed ("" when unset); verl's door parses it
    once into a `TeacherEntry` (`integrations.verl.entry`)."""
    return environment(environ).get(VERL_TEACHER, "").strip()


def opd_values(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """slime_opd's variables that are set ({name: text}); slime's door parses them once into an
    `OpdSettings` (`integrations.megatron.opd.opd_settings`)."""
    env = environment(environ)
    return {name: env[name] for name in OPD_VARIABLES if env.get(name) is not None}


def launcher_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank as the launcher announced it (0 when none did)."""
    env = environment(environ)
    value = str(next((env[name] for name in RANK_VARIABLES if name in env), "0")).strip()
    return ascii_int(value) or 0


def api_key(variable: str) -> str | None:
    """The API key the variable `variable` holds (a served teacher's: `ClientSettings.api_key_env`),
    None where it is unset or empty."""
    return os.environ.get(variable) or None


def ca_variables() -> tuple[str | None, str | None]:
    """SSL_CERT_FILE and SSL_CERT_DIR (OpenSSL's system CAs when no bundle is given)."""
    return os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")


def c_compiler() -> str | None:
    """$CC as written (None: unset or empty): the compiler the invariant mode's C kernel is built with."""
    return os.environ.get("CC") or None


def cache_root() -> str:
    """$XDG_CACHE_HOME, else ~/.cache: where the C kernel's build is cached."""
    return os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")


def slime_routing_replay_stage() -> str | None:
    """slime's routing-replay stage (ROUTING_REPLAY_STAGE: "record", "replay_forward",
    "replay_backward", "fallthrough") where its replay is on (ENABLE_ROUTING_REPLAY=1), else None.
    slime's own variables, which slime sets between its passes and around its model call: read at each
    call, never held."""
    if os.environ.get("ENABLE_ROUTING_REPLAY", "0") != "1":
        return None
    return os.environ.get("ROUTING_REPLAY_STAGE")


def triton_interpreted() -> bool:
    """Whether TRITON_INTERPRET asks Triton's interpreter (Triton reads it when a kernel is decorated)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on", "y")


# ---- a child process's environment (the test kit's servers and ranks; nothing a door reads)


def child_environment(extra: Mapping[str, str] | None = None, ours: bool = True) -> dict[str, str]:
    """This process's environment as a child it starts inherits it, with `extra` set on top;
    without `ours`, none of the package's own variables (a child given only the ones it is handed)."""
    env = {name: value for name, value in os.environ.items() if ours or not name.startswith(PREFIX)}
    return {**env, **(extra or {})}


def process_environment() -> MutableMapping[str, str]:
    """This process's environment itself, for the test kit to set a block's variables in (every
    child started inside inherits them: `testing.environ`) or to adopt its caller's (a spawned rank)."""
    return os.environ
