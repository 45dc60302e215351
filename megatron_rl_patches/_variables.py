"""Every environment variable megatron-rl-patches reads, in one table: its name and what it means
(--help, `doctor`). The misspelling check, the launcher, `doctor` and --help read this table, and
every module that reads a variable takes its name from here (tests/apps/cli/test_variable_table.py
holds every name the package, the docs and --help write to it), so a variable cannot be read
without being known. A leaf: standard library only (the start-up hook and the ops import it)."""
from __future__ import annotations

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

_SWITCH = {**dict.fromkeys(("1", "true", "on", "yes"), True), **dict.fromkeys(("0", "false", "off", "no"), False),
           "": None}


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


def _shown(text: str | None, limit: int = 40) -> str | None:
    """`text`'s first `limit` characters (a pasted megabyte must not flood stderr)."""
    return text if text is None else text[:limit]
