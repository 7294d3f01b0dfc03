"""The new-run form: its fields, how they become a RunSpec, and where each validation error is shown.

Each field names the RunSpec path it fills (`group_size` -> `rollout.group_size`); the template renders
the fields from this one table. Empty fields are left out, so the spec's own defaults apply. The YAML box
is merged over the fields (YAML wins), which reaches every spec option the fields do not show.

Validation is the spec's own (`locojax.spec.parse_spec`) and then the runs service's (paths, decision ids):
the dashboard adds no rules of its own. Each error lands next to what caused it: the YAML box when the
YAML set that path, else the field for that path, else the fieldset of its section, else the form's top.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from locojax.modes import KIND_MODES, MODES
from locojax.spec import AlgoSpec, RunSpec, SpecError, parse_spec

Kind = Literal["text", "int", "float", "select"]


@functools.cache
def _presets() -> list[str]:
    from locojax.model.config import PRESETS

    return list(PRESETS)


@functools.cache
def _tasks() -> list[str]:
    from locojax.tasks import TASKS

    return list(TASKS.names())


@functools.cache
def hardware_names() -> list[str]:
    from locojax.placement import HARDWARE

    return list(HARDWARE.names())


@functools.cache
def workload_names() -> list[str]:
    from locojax.placement import WORKLOADS

    return list(WORKLOADS.names())


def model_names() -> list[str]:
    return _presets()


def _algorithms() -> list[str]:
    return list(typing.get_args(AlgoSpec.model_fields["name"].annotation))


def _modes() -> list[str]:
    # A placement's modes: the registered ones, less those a spec's kind selects (SFT).
    return [name for name in MODES if name not in KIND_MODES.values()]


@dataclass(frozen=True)
class FormField:
    name: str  # the input's name (and the query parameter that prefills it)
    path: str  # where it goes in the RunSpec
    label: str
    kind: Kind = "int"
    choices: Callable[[], list[str]] | None = None
    help: str = ""


@dataclass(frozen=True)
class FieldGroup:
    id: str  # also the spec section whose section-wide errors show at the top of this fieldset
    title: str
    fields: tuple[FormField, ...]


GROUPS: tuple[FieldGroup, ...] = (
    FieldGroup("run", "Run", (
        FormField("name", "name", "Name", "text", help="letters, digits, . _ -"),
        FormField("steps", "steps", "Steps"),
        FormField("seed", "seed", "Seed"),
        FormField("max_restarts", "max_restarts", "Max restarts", help="automatic recoveries after a lost host"),
    )),
    FieldGroup("model", "Model and task", (
        FormField("preset", "model.preset", "Model preset", "select", _presets),
        FormField("task", "task.name", "Task", "select", _tasks),
        FormField("task_path", "task.path", "Task data file", "text", help="gsm8k and math: a local JSONL or parquet"),
        FormField("difficulty", "task.difficulty", "Difficulty", help="generated tasks, 1-5"),
    )),
    FieldGroup("rollout", "Rollout", (
        FormField("prompts_per_step", "rollout.prompts_per_step", "Prompts per step"),
        FormField("group_size", "rollout.group_size", "Group size", help="completions per prompt"),
        FormField("max_new_tokens", "rollout.max_new_tokens", "Max new tokens"),
        FormField("temperature", "rollout.temperature", "Temperature", "float"),
    )),
    FieldGroup("algo", "Algorithm", (
        FormField("algo", "algo.name", "Algorithm", "select", _algorithms),
        FormField("lr", "optim.lr", "Learning rate", "float"),
        FormField("kl_coef", "algo.kl_coef", "KL coefficient", "float"),
    )),
    FieldGroup("placement", "Placement", (
        FormField("mode", "placement.mode", "Mode", "select", _modes, help="co: colocated, da: disaggregated, "
                                                                          "sc: single controller"),
        FormField("hosts", "placement.hosts", "Hosts"),
        FormField("devices_per_host", "placement.devices_per_host", "Devices per host"),
        FormField("rollout_fraction", "placement.rollout_fraction", "Rollout fraction", "float",
                  help="da only: share of hosts doing rollout"),
        FormField("decision_id", "placement.decision_id", "Placement decision", help="set by the recommender"),
    )),
)
FIELDS: dict[str, FormField] = {item.name: item for group in GROUPS for item in group.fields}
# Sections of the spec whose section-wide errors (a model validator's) show on a fieldset.
_SECTION_GROUP = {"model": "model", "task": "model", "rollout": "rollout", "algo": "algo", "optim": "algo",
                  "placement": "placement"}
YAML_MAX_BYTES = 64 * 1024  # the new-run form's YAML box
# Inputs of "ask the recommender" that are not part of the spec.
RECOMMEND_FIELDS = ("hardware", "chips", "workload")
# Fields of a recommendation request, mapped to the form input that fills them.
_RECOMMEND_INPUT = {"model": "preset", "gen_len": "max_new_tokens", "hardware": "hardware", "chips": "chips",
                    "workload": "workload", "prompts_per_step": "prompts_per_step", "group_size": "group_size"}


def _get(document: Mapping[str, Any], path: str) -> Any:
    value: Any = document
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def _set(document: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        document = document.setdefault(part, {})
    document[leaf] = value


def _has(document: Any, path: str) -> bool:
    """Whether the YAML box set `path`."""
    for part in path.split(".") if path else []:
        if not isinstance(document, Mapping) or part not in document:
            return False
        document = document[part]
    return bool(path)


def deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


@functools.cache
def default_values() -> dict[str, str]:
    defaults = RunSpec().model_dump(mode="json")
    values = {}
    for name, item in FIELDS.items():
        value = _get(defaults, item.path)
        values[name] = "" if value is None else str(value)
    values.update(hardware="local-cpu", chips="", workload="")  # workload: the task's, unless chosen
    return values


@dataclass
class RunForm:
    """What the form shows and the errors to show beside it (keyed by input name, `group:<id>`, `yaml`,
    `recommend` or `form`)."""

    values: dict[str, str]
    yaml_text: str = ""
    errors: dict[str, list[str]] = field(default_factory=dict)
    recommendation: Any = None  # the placement decision the recommender just made
    overrides: dict[str, Any] = field(default_factory=dict)  # the YAML box, parsed by `spec()`

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "RunForm":
        """From a posted form or a query string; what is missing takes the spec's defaults."""
        values = dict(default_values())
        for name in (*FIELDS, *RECOMMEND_FIELDS):
            value = data.get(name)
            if isinstance(value, str):
                values[name] = value.strip()
        if not values["workload"]:
            # The recommender's workload profiles are named after the tasks they model.
            values["workload"] = values["task"] if values["task"] in workload_names() else workload_names()[0]
        yaml_text = data.get("spec_yaml")
        return cls(values=values, yaml_text=yaml_text if isinstance(yaml_text, str) else "")

    def add_error(self, where: str, message: str) -> None:
        self.errors.setdefault(where, []).append(message)

    def errors_for(self, where: str) -> list[str]:
        return self.errors.get(where, [])

    # --- building the spec ------------------------------------------------------------------------

    def _yaml_document(self) -> dict[str, Any] | None:
        size = len(self.yaml_text.encode("utf-8", "surrogatepass"))
        if size > YAML_MAX_BYTES:
            # Refused before parsing: YAML aliases make a small document expensive, a large one more so.
            self.add_error("yaml", f"the YAML box holds {size} bytes; at most {YAML_MAX_BYTES // 1024} KiB")
            return None
        if not self.yaml_text.strip():
            return {}
        try:
            document = yaml.safe_load(self.yaml_text)
        except yaml.YAMLError as exc:
            self.add_error("yaml", f"not valid YAML: {exc}")
            return None
        if document is None:
            return {}
        if not isinstance(document, dict):
            self.add_error("yaml", f"expected a mapping of spec fields, got {type(document).__name__}")
            return None
        return document

    def spec(self) -> RunSpec | None:
        """The RunSpec these values describe, or None with the reasons recorded in `errors`."""
        document: dict[str, Any] = {}
        for name, item in FIELDS.items():
            value = self.values.get(name, "")
            if value != "":
                _set(document, item.path, value)
        overrides = self._yaml_document()
        if overrides is None:
            return None
        self.overrides = overrides
        document = deep_merge(document, overrides)
        try:
            return parse_spec(document, "form")
        except SpecError as exc:
            for path, message in exc.errors:
                self.place_error(path, message)
            return None

    def place_error(self, path: str, message: str) -> None:
        path = path.removeprefix("spec.") if path != "spec" else ""
        if _has(self.overrides, path):
            self.add_error("yaml", f"{path}: {message}")
            return
        for name, item in FIELDS.items():
            if path == item.path or path.startswith(item.path + "."):
                self.add_error(name, message)
                return
        section = path.split(".")[0]
        if section in _SECTION_GROUP:
            self.add_error("group:" + _SECTION_GROUP[section], f"{path}: {message}" if "." in path else message)
        elif path:
            self.add_error("yaml", f"{path}: {message}")  # a field only the YAML box can reach
        else:
            self.add_error("form", message)

    def place_service_errors(self, details: Any, message: str) -> None:
        """Errors from the runs service (`details` = [{"field": "spec.task.path", "message": ...}])."""
        placed = False
        if isinstance(details, list):
            for item in details:
                if isinstance(item, dict) and "message" in item:
                    self.place_error(str(item.get("field", "")), str(item["message"]))
                    placed = True
        if not placed:
            self.add_error("form", message)

    # --- asking the recommender -------------------------------------------------------------------

    def recommend_request(self) -> dict[str, Any]:
        """The recommender's request from these values: model from the preset, the workload, and the chip
        budget (default: hosts x devices per host)."""
        values = self.values
        chips = values.get("chips") or ""
        if not chips:
            try:
                chips = str(int(values.get("hosts") or 1) * int(values.get("devices_per_host") or 1))
            except ValueError:
                chips = ""
        request = {"model": values.get("preset", ""), "hardware": values.get("hardware", ""), "chips": chips,
                   "workload": values.get("workload") or values.get("task", ""),
                   "prompts_per_step": values.get("prompts_per_step") or None,
                   "group_size": values.get("group_size") or None, "gen_len": values.get("max_new_tokens") or None}
        return {key: value for key, value in request.items() if value is not None}

    def place_recommend_errors(self, errors: list[tuple[str, str]]) -> None:
        for name, message in errors:
            target = _RECOMMEND_INPUT.get(name.split(".")[0])
            self.add_error(target if target else "recommend", message)

    def apply_option(self, option: Mapping[str, Any], decision_id: int | None) -> None:
        """Fill the placement fields from one priced option."""
        hosts = max(1, int(option["hosts"]))
        self.values.update(
            mode=str(option["mode"]), hosts=str(hosts), devices_per_host=str(max(1, int(option["chips"]) // hosts)),
            rollout_fraction="" if option.get("rollout_fraction") is None else str(option["rollout_fraction"]),
            decision_id="" if decision_id is None else str(decision_id),
        )


def validation_errors(exc: ValidationError) -> list[tuple[str, str]]:
    return [(".".join(str(part) for part in error["loc"]), error["msg"]) for error in exc.errors()]


def option_query(option: Mapping[str, Any], request: Mapping[str, Any], decision_id: int | None) -> dict[str, str]:
    """Query parameters that open the new-run form with this placement (and the explorer's workload)."""
    hosts = max(1, int(option["hosts"]))
    query = {"preset": str(request.get("model", "")), "mode": str(option["mode"]), "hosts": str(hosts),
             "devices_per_host": str(max(1, int(option["chips"]) // hosts))}
    if option.get("rollout_fraction") is not None:
        query["rollout_fraction"] = str(option["rollout_fraction"])
    workload = request.get("workload")
    if workload in _tasks():
        query["task"] = str(workload)
    for name in ("prompts_per_step", "group_size"):
        if request.get(name):
            query[name] = str(request[name])
    if request.get("gen_len"):
        query["max_new_tokens"] = str(request["gen_len"])
    if decision_id is not None:
        query["decision_id"] = str(decision_id)
    query["hardware"] = str(request.get("hardware", ""))
    query["chips"] = str(request.get("chips", ""))
    return query
