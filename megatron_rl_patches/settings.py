"""The package's settings: every environment variable megatron-rl-patches reads, in one table (its
name and what it means: --help, `doctor`, the misspelling check, `run`), the syntax of their values
(one parser each), and the one place outside the start-up machinery (`patching/`) and the apps where
the environment is read (`# ---- reading`; the test kit's child processes take theirs from here too).

A setting is read once, at the door of whoever uses it (an op's public call, a framework's patch
entry, a client's constructor), into a typed value passed down as an argument: nothing below a door
reads the environment. To add a setting (docs/design.md, "Where to add ... a setting"): its name and
meaning in `MEANINGS`, its parser in `# ---- values` when it needs one, one reader in `# ---- reading`
(`environ`: a mapping to read instead of the process's, for `doctor` and the tests), and the door's
call. tests/apps/cli/test_variable_table.py holds every name the package, the docs and --help write
to this table; tests/test_settings_reads.py holds every read of the environment to this module.

Standard library only and cheap: the start-up hook imports it in every Python process."""
from __future__ import annotations

import os

TYPE_CHECKING = False  # not typing's: this module runs at start-up (see patching/env.py)
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, MutableMapping

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

# The variables a user sets -> what they mean (--help's epilog, `doctor`'s environment section).
MEANINGS: dict[str, str] = {
    SELECT: '"all" (or "1") or comma-separated patch names: applied in every Python process at start-up; '
            'unset, "" or "0": off',
    DISABLE: "comma-separated patch names removed from any selection",
    STRICT: '1/true/yes/on: patch problems raise instead of warning (0/false/no/off/"": warn)',
    # slime's default roles: integrations.slime.roles.DEFAULT_INFERENCE_ROLES (a test holds them equal)
    INFERENCE_ROLES: "comma-separated roles built inference-only, each once (unset: slime's teacher roles "
                     'prm_teacher,teacher; "": none); role:mode keeps its weights off the device, mode resident, '
                     "swap or stream (e.g. teacher:swap,prm_teacher:stream); role;tp=N (or role:mode;tp=N) "
                     "builds the role's model at its own tensor-parallel size (quote the ';')",
    ALLOW_UNTESTED: "1: apply patches outside their supported megatron-core range (one warning each)",
    BACKEND: "the vocabulary ops' tile backend: torch, triton or gemm (any case); unset, \"\" or \"auto\": each op "
             "picks the first backend that runs on its tensors' device (triton on CUDA when installed, else "
             "torch); an op's backend= argument wins",
    INVARIANT: "1/true/yes/on: the vocabulary ops run in the invariant mode (each row's values from that row "
               "and the weights alone, bit for bit, whatever the batch and the layout; "
               "docs/train-rollout-agreement.md); 0/false/no/off: the default mode; unset or \"\": an op's "
               "invariant= argument, else the model config's batch_invariant_mode",
    NATIVE: "0/false/no/off: the invariant mode's CPU sums run on the torch tiles; unset, \"\" or 1/true/yes/on: "
            "on a C kernel built at first use with $CC (else cc or gcc; cached under $XDG_CACHE_HOME or ~/.cache), "
            "the torch tiles where no compiler builds it. Every rank of a tensor-parallel group must run the same "
            "(their bits differ)",
    OPD_TEACHERS: "slime_opd: comma-separated teachers, PATH (a checkpoint of the actor's architecture, or a "
                  "Hugging Face directory of another supported family: built by build_inference_model_from_hf) or "
                  "PATH@module:function; a Hugging Face directory at its own layout: PATH;tp=N and/or "
                  "PATH;pp=N (its own tensor / pipeline-parallel sizes over all ranks); a Hugging Face "
                  "directory with another tokenizer than the student's: PATH;tokenizer=own, optionally "
                  "followed by ;stop_tokens=module:function (a student special id -> the teacher's id or "
                  "None); a teacher served by vLLM: http(s)://host:port;engine=vllm (;tokenizer=DIR for another "
                  "tokenizer; no user:pass@ in the URL: the key goes in MEGATRON_RL_PATCHES_TEACHER_API_KEY); quote "
                  "the ';'; read by slime's training actors and, for ;context=KEY entries and "
                  "MEGATRON_RL_PATCHES_OPD_SCORE_AT=rollout, by its rollout manager: set it in the job's runtime_env "
                  "(it reaches both; --train-env-vars reaches the training actors only)",
    OPD_WEIGHTS: "slime_opd: mixture weights, one per teacher, summing to 1 (unset: uniform)",
    OPD_K: "slime_opd: the student's top-k ids per token (default 16), or vocab (the divergence over the whole "
           "vocabulary from the teachers' hidden states)",
    OPD_DIVERGENCE: "slime_opd: reverse_kl (default), forward_kl, jsd, skew_forward_kl, skew_reverse_kl, tv or "
                    "mixed_kl",
    OPD_COEF: "slime_opd: weight of the top-k divergence (default 1.0)",
    OPD_POLICY_WEIGHT: "slime_opd: weight of slime's policy loss (default 1.0)",
    OPD_RESIDENCY: "slime_opd: resident (default), swap or stream, for the separate teachers "
                   "(PATH@module:function, Hugging Face folders of another architecture)",
    OPD_IDS_FROM: "slime_opd: student (default), union (the student's and the first teacher's top-k) or teacher "
                  "(the first teacher's own top-k)",
    OPD_SCORE_AT: "slime_opd: where a served teacher of the student's tokenizer (top-k route) is asked: train "
                  "(default: by the train step) or rollout (each sample as its generation ends; its rows carried "
                  "with the sample to the training ranks); read by slime's rollout manager only: set it in the job's "
                  "runtime_env, beside MEGATRON_RL_PATCHES_OPD_TEACHERS (--train-env-vars does not reach the rollout "
                  "manager; with no teachers there it warns once and the train step asks)",
    VERL_ROWS: "verl_fused_logprobs: all computes every row, not only the rows verl reads",
    SHARED_PREFIX: "1/true/yes/on: slime's passes (training, old and reference log-probs, in-process teachers, the "
                   "live self-teacher) pack each micro-batch by shared prefix: samples sharing leading tokens (a "
                   "group's prompt, a privileged context) compute them once, exactly (docs/shared-prefix.md); "
                   "0/false/no/off, unset or \"\": each sample packed whole",
    VERL_TEACHER: "verl_topk_kd: a teacher served by vLLM answering verl's teacher-loop client, "
                  "http(s)://host:port;engine=vllm (its --max-logprobs at least verl's topk), or a pooling "
                  "server with ;head=DIR (any K; on verl's fused route the whole-vocabulary KL); unset: verl's own "
                  "teacher replicas; set in the agent-loop and trainer workers' environment",
    TEACHER_API_KEY: "the API key sent to a teacher served by an inference engine (teachers.ServedTeacher), "
                     "as a bearer token; never part of a URL or an entry",
}
VARIABLES = tuple(MEANINGS)  # set by users
READ = (*VARIABLES, LAUNCHER_ROOT)  # every variable the package reads
OPD_VARIABLES = (OPD_TEACHERS, OPD_WEIGHTS, OPD_K, OPD_DIVERGENCE, OPD_COEF, OPD_POLICY_WEIGHT, OPD_RESIDENCY,
                 OPD_IDS_FROM, OPD_SCORE_AT)
# Launchers' rank variables (torchrun, slurm, Open MPI, MPICH): read where torch.distributed is not
# initialized yet, e.g. at interpreter start-up.
RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")

# ---- values: the syntax of a setting's text, one parser each (the launcher, `doctor` and the doors read alike)

_SWITCH = {**dict.fromkeys(("1", "true", "on", "yes"), True), **dict.fromkeys(("0", "false", "off", "no"), False),
           "": None}
_DIGITS = frozenset("0123456789")
_LONGEST = 4000  # int() refuses longer digit strings (sys.int_info.default_max_str_digits): not a size anyway


def ascii_int(text: str) -> int | None:
    """`text` as an int when it is one or more ASCII digits 0-9 and nothing else (no sign, space, '_'
    or another script's digits); None otherwise, for the caller's error naming its setting.
    `str.isdigit()` takes '²' (which `int()` then refuses with a bare "invalid literal"), and `int()`
    takes '٣', '３', '1_0' and '+2': a size written so would be misread or escape as an error naming
    nothing."""
    if not text or len(text) > _LONGEST or not set(text) <= _DIGITS:
        return None
    return int(text)


def invariant_setting(text: str | None) -> bool | None:
    """MEGATRON_RL_PATCHES_INVARIANT's value read: True, False, or None when unset or ""; ValueError
    naming the variable for any other text (the ops and the launcher read it with this one parser)."""
    word = (text or "").strip().lower()
    if word not in _SWITCH:
        raise ValueError(f"{INVARIANT}={_shown(text)!r} is not a switch: use 1 (invariant vocabulary ops) or 0 (the "
                         f"default mode), or leave it unset")
    return _SWITCH[word]


def native_setting(text: str | None) -> bool:
    """MEGATRON_RL_PATCHES_NATIVE's value read: False for a switch off, else True (unset or ""
    included); ValueError naming the variable for any other text."""
    word = (text or "").strip().lower()
    if word not in _SWITCH:
        raise ValueError(f"{NATIVE}={_shown(text)!r} is not a switch: use 0 (the torch tiles) or 1 (the compiled "
                         f"kernel), or leave it unset")
    return _SWITCH[word] is not False


def shared_prefix_setting(text: str | None) -> bool:
    """MEGATRON_RL_PATCHES_SHARED_PREFIX's value read: True for a switch on, False when off, unset or
    ""; ValueError naming the variable for any other text."""
    word = (text or "").strip().lower()
    if word not in _SWITCH:
        raise ValueError(f"{SHARED_PREFIX}={_shown(text)!r} is not a switch: use 1 (pack by shared prefix) or 0 "
                         "(each sample whole), or leave it unset")
    return _SWITCH[word] is True


def verl_rows_setting(text: str | None) -> bool:
    """MEGATRON_RL_PATCHES_VERL_ROWS's value read: True for "all" (any case), False when unset or "";
    ValueError naming the variable for any other text."""
    word = (text or "").strip().lower()
    if word not in ("all", ""):
        raise ValueError(f"{VERL_ROWS}={_shown(text)!r} is not a row choice: use all (every row), or leave it "
                         "unset for the rows verl reads")
    return word == "all"


AUTO = "auto"
BUILTIN_BACKENDS = ("torch", "triton", "gemm")  # the backends that always exist; others register by name at run time


def parse_backend(value: str | None, known: Iterable[str] = BUILTIN_BACKENDS) -> str:
    """MEGATRON_RL_PATCHES_BACKEND's value read, trimmed and lower-cased (one parser for the launcher,
    `doctor` and the ops): "auto" for None, "" or "auto"; ValueError naming the variable and the
    accepted words for anything else."""
    word = (value or "").strip().lower()
    names = tuple(known)
    if not word or word == AUTO:
        return AUTO
    if word in names:
        return word
    shown = value if value is None or len(value) <= 40 else f"{value[:37]}..."
    raise ValueError(f"{BACKEND}={shown!r} is not a backend: use {' or '.join(names)} (any case), "
                     f"or {AUTO}, \"\" or unset to let each op choose")


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


def _shown(text: str | None, limit: int = 40) -> str | None:
    """`text`'s first `limit` characters (a pasted megabyte must not flood stderr)."""
    return text if text is None else text[:limit]


# ---- reading: the environment, read here only (each reader at call time: a door calls it once)


def environment(environ: Mapping[str, str] | None = None) -> Mapping[str, str]:
    """`environ`, or this process's environment."""
    return os.environ if environ is None else environ


def invariant(environ: Mapping[str, str] | None = None) -> bool | None:
    """MEGATRON_RL_PATCHES_INVARIANT: True, False, or None when unset or "" (`invariant_setting`)."""
    return invariant_setting(environment(environ).get(INVARIANT))


def backend(environ: Mapping[str, str] | None = None, known: Iterable[str] = BUILTIN_BACKENDS) -> str:
    """MEGATRON_RL_PATCHES_BACKEND (`parse_backend`)."""
    return parse_backend(environment(environ).get(BACKEND), known)


def native(environ: Mapping[str, str] | None = None) -> bool:
    """MEGATRON_RL_PATCHES_NATIVE (`native_setting`)."""
    return native_setting(environment(environ).get(NATIVE))


def verl_rows(environ: Mapping[str, str] | None = None) -> bool:
    """MEGATRON_RL_PATCHES_VERL_ROWS (`verl_rows_setting`)."""
    return verl_rows_setting(environment(environ).get(VERL_ROWS))


def shared_prefix(environ: Mapping[str, str] | None = None) -> bool:
    """MEGATRON_RL_PATCHES_SHARED_PREFIX (`shared_prefix_setting`); slime's door reads it once."""
    return shared_prefix_setting(environment(environ).get(SHARED_PREFIX))


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
