"""Hydra composition and the composed tree parsed onto the schema (old key names renamed)."""
from __future__ import annotations

import copy
import os
import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from .errors import ConfigError
from .schema import Config


def _conf_dir() -> str:
    """The Hydra configs: trainer/conf/ in an installed package (the wheel ships the repository's
    conf/ there: pyproject.toml's package-dir), else conf/ beside the package (a source checkout
    and an editable install)."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the trainer package
    installed = os.path.join(here, "conf")
    return installed if os.path.isfile(os.path.join(installed, "config.yaml")) else \
        os.path.join(os.path.dirname(here), "conf")


CONF_DIR = _conf_dir()


def compose(overrides: list[str]) -> DictConfig:
    """The composed Hydra config of `python -m trainer <overrides>` (same conf/ dir and defaults),
    not yet typed: trainer.run.resolve.configure.compose_config gives the validated Config."""
    from hydra import compose as hydra_compose, initialize_config_dir
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return hydra_compose(config_name="config", overrides=renamed_overrides(list(overrides)))


def parse(cfg: Any) -> Config:
    """A Hydra/OmegaConf tree (or a plain dict, or a Config) merged onto the schema, old key names
    moved to their new ones (RENAMED); not yet resolved against the data files nor validated
    (trainer.run.resolve.configure.load_config does both)."""
    if isinstance(cfg, Config):
        return cfg
    base = OmegaConf.structured(Config)
    plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    plain = _renamed_tree(copy.deepcopy({k: v for k, v in dict(plain).items() if k != "hydra"}))
    try:
        merged = OmegaConf.merge(base, plain)
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except Exception as exc:  # omegaconf's errors: one line naming the key
        raise ConfigError(_one_line(exc)) from exc


def _one_line(exc: Exception) -> str:
    """An OmegaConf error as one line naming its key: `train.nosuch: no such key ...` or
    `model.embedding_dim=abc: Value 'abc' of type 'str' could not be converted to Integer`."""
    key = getattr(exc, "full_key", None)
    msg = (str(getattr(exc, "msg", None) or exc).strip().splitlines() or [type(exc).__name__])[0]
    if not key:
        return f"invalid config: {msg}"
    if isinstance(exc, ConfigKeyError):
        section = key.rsplit(".", 1)[0] if "." in key else "the config"
        return f"{key}: no such key in {section} (docs/config.md lists every key)"
    value = getattr(exc, "value", None)
    return f"{key}={value}: {msg}" if value is not None else f"{key}: {msg}"


# keys renamed: old name -> new name. An old name still works for one release: an override or a config
# tree that gives it is read as the new key, with one warning line; giving both in overrides with
# different values is an error. The schema and conf/ hold only the new names.
RENAMED = {
    "train.bag": "train.ensemble",
    "embedding.tables": "embedding.kind",  # a kind (fixed | dynamic), unlike the per-table cache.tables
    "data.eval_samples": "data.test_samples",  # the test split: data.val_* is validation
    "data.eval_fraction": "data.test_fraction",
}


def renamed_overrides(overrides: list[str]) -> list[str]:
    """Hydra overrides ([+|++|~]key[=value]) with every old key name (RENAMED) replaced by its new
    one, saying so on stderr (the launcher's rank 0 only: this runs before the collectives are
    up). ConfigError when an old and a new name are both given with different values."""
    out, given = [], {}  # given: new key -> [(the override as typed, its value, under the old name)]
    for arg in overrides:
        prefix = arg[:len(arg) - len(arg.lstrip("+~"))]
        typed, eq, value = arg[len(prefix):].partition("=")
        key = RENAMED.get(typed.strip(), typed.strip())
        if key != typed.strip():
            _warn(typed.strip(), key, f"{typed.strip()}{eq}{value} -> {key}{eq}{value}")
            arg = f"{prefix}{key}{eq}{value}"
        if eq and key in RENAMED.values():  # the same key twice under its new name: the last wins (Hydra)
            seen = given.setdefault(key, [])
            now = (f"{typed.strip()}={value}", value, key != typed.strip())
            clash = next((s for s in seen if s[1] != value and (s[2] or now[2])), None)
            if clash is not None:
                old = next(k for k, v in RENAMED.items() if v == key)
                raise ConfigError(f"{clash[0]} and {now[0]}: {old} is the old name of {key}: give only {key}")
            seen.append(now)
        out.append(arg)
    return out


def _renamed_tree(plain: dict) -> dict:
    """A config tree (nested dicts) with the value of every old key name it sets moved to the new
    name (the old value wins: a composed tree always holds the new key's default)."""
    for old, new in RENAMED.items():
        (old_parent, old_name), (new_parent, new_name) = old.rsplit(".", 1), new.rsplit(".", 1)
        parent = _subtree(plain, old_parent)
        if not isinstance(parent, dict) or old_name not in parent:
            continue
        value = parent.pop(old_name)
        if value is None:  # an old YAML's placeholder: nothing set
            continue
        target = _subtree(plain, new_parent, create=True)
        target[new_name] = value
        _warn(old, new, f"{old}={value} -> {new}={value}")
    return plain


def _subtree(tree: dict, dotted: str, create: bool = False):
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        if part not in node and create:
            node[part] = {}
        node = node.get(part)
    return node


def _warn(old: str, new: str, moved: str) -> None:
    if launcher_rank() == 0:
        print(f"[trainer] warning: {old} is deprecated, use {new} ({moved}); {old} will be removed in the "
              "next release", file=sys.stderr)


LAUNCHER_RANKS = ("HOROVOD_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")  # set by a launcher, in this order


def launcher_rank() -> int:
    """This process's rank as its launcher set it (horovodrun: HOROVOD_RANK, torchrun: RANK, mpirun:
    OMPI_COMM_WORLD_RANK / PMI_RANK, srun: SLURM_PROCID), 0 alone: known before (and without) a
    process group, so a config's warnings come once and a job that failed to start can be reported."""
    for key in (*LAUNCHER_RANKS, "SLURM_PROCID"):
        if os.environ.get(key, "").strip().isdigit():
            return int(os.environ[key])
    return 0


SLURM_PORT_BASE, SLURM_PORTS = 15000, 10000  # MASTER_PORT from the job id: 15000..24999 (below 29500 and ephemerals)


def _first_host(nodelist: str) -> str:
    """The first name of a Slurm host list ("n[07-09,12],gpu3" -> "n07"), as `scontrol show
    hostnames` prints it first."""
    head, depth = "", 0
    for ch in nodelist.strip():
        if ch == "," and depth == 0:
            break
        depth += (ch == "[") - (ch == "]")
        head += ch
    if "[" not in head:
        return head
    prefix, rest = head.split("[", 1)
    ranges, suffix = rest.split("]", 1)
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def _tasks_here(per_node: str, node: int) -> int:
    """The tasks on node `node` of a Slurm tasks-per-node list ("2(x3),1": 2, 2, 2, 1)."""
    counts: list[int] = []
    for part in per_node.split(","):
        n, _, times = part.partition("(x")
        counts += [int(n)] * (int(times.rstrip(")")) if times else 1)
    return counts[node] if node < len(counts) else counts[-1]


def slurm_port(job_id: int, restart: int = 0) -> int:
    """A Slurm job's MASTER_PORT: 15000 + (job id + 997 x SLURM_RESTART_COUNT) mod 10000, so a requeued
    job does not ask for the port its previous run's rank 0 may still hold while it exits
    (scripts/slurm/train.sbatch computes the same)."""
    return SLURM_PORT_BASE + (job_id + 997 * restart) % SLURM_PORTS


def adopt_slurm(env: "dict[str, str] | os._Environ[str]" = os.environ) -> dict[str, str]:
    """A task that srun started (one per rank) gets torchrun's variables from Slurm's, when no launcher
    set its rank: RANK <- SLURM_PROCID, WORLD_SIZE <- SLURM_NTASKS, LOCAL_RANK <- SLURM_LOCALID,
    LOCAL_WORLD_SIZE <- this node's tasks (SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID), and, unless
    the batch script exported them, MASTER_ADDR <- the first host of SLURM_JOB_NODELIST and MASTER_PORT
    <- slurm_port (job id and restart count). Only for a step of more than one task (SLURM_STEP_ID set: not the
    batch shell); a launcher's variables (torchrun, horovodrun, mpirun: LAUNCHER_RANKS, WORLD_SIZE) win,
    except srun's own PMI_RANK (the same rank). Sets them in `env` and returns what it set."""
    if "SLURM_STEP_ID" not in env or not env.get("SLURM_PROCID", "").isdigit():
        return {}
    world = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1")
    launched = [k for k in (*LAUNCHER_RANKS, "WORLD_SIZE") if k in env
                and not (k == "PMI_RANK" and env[k] == env["SLURM_PROCID"])]
    if world <= 1 or launched:
        return {}
    node = int(env.get("SLURM_NODEID", "0"))
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world)
    got = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": str(world), "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
           "LOCAL_WORLD_SIZE": str(_tasks_here(per_node, node))}
    if "MASTER_ADDR" not in env:
        got["MASTER_ADDR"] = _first_host(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])
    if "MASTER_PORT" not in env:
        got["MASTER_PORT"] = str(slurm_port(int(env.get("SLURM_JOB_ID", "0")), int(env.get("SLURM_RESTART_COUNT") or 0)))
    env.update(got)
    return got


def get_key(c: Config, key: str) -> Any:
    obj = c
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj
