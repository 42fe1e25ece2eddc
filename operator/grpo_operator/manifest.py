"""Load a GRPORun manifest and check it the way the API server would: outside a cluster, with the CRD itself.

The order follows the API server's: drop nulls and report unknown fields (a structural schema prunes them; for a
user an unknown field is nearly always a typo, so here it is an error), apply the schema's defaults, validate types
and ranges (jsonschema, Draft 4 because CRDs use OpenAPI 3.0's boolean `exclusiveMinimum`), then evaluate every
`x-kubernetes-validations` CEL rule with cel-python. Every error is one line that starts with the field path.
"""

from __future__ import annotations

import copy
import difflib
import functools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml
from celpy import celtypes

from grpo_operator.api import GRPORunSpec, SpecError, parse_spec
from grpo_operator.status.durability import unkept_work

#: Overridable so an installed operator image can point at the CRD it ships.
CRD_PATH = Path(os.environ.get("GRPO_CRD_PATH", Path(__file__).resolve().parents[2] / "crds" / "grporun.yaml"))


class ManifestError(Exception):
    """A manifest that could not be read as a GRPORun at all; the message is one line and names the file."""


class ManifestInvalid(ManifestError):
    """A GRPORun that breaks the schema or its rules; `errors` holds one line per problem."""

    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = errors


@dataclass(frozen=True)
class Crd:
    document: dict[str, Any]

    @property
    def api_version(self) -> str:
        return f"{self.document['spec']['group']}/{self._version['name']}"

    @property
    def kind(self) -> str:
        return self.document["spec"]["names"]["kind"]

    @property
    def schema(self) -> dict[str, Any]:
        return self._version["schema"]["openAPIV3Schema"]

    @property
    def _version(self) -> dict[str, Any]:
        return next(version for version in self.document["spec"]["versions"] if version.get("storage"))


@functools.cache
def load_crd(path: Path = CRD_PATH) -> Crd:
    return Crd(yaml.load(Path(path).read_text(), Loader=_Loader))


# --------------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------------
class _Loader(yaml.SafeLoader):
    """PyYAML reads `1e-6` as a string (YAML 1.1 wants `1.0e-6`); kubectl's Go YAML reads it as a float. A learning
    rate written the way papers write it must not fail with 'is not of type number'."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read one GRPORun from a YAML file; raises ManifestError with a one-line message."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ManifestError(f"cannot read {path}: {getattr(error, 'strerror', None) or error}") from None
    try:
        documents = [doc for doc in yaml.load_all(text, Loader=_Loader) if doc is not None]
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ManifestError(f"{path} is not valid YAML{where}: {problem}") from None
    if len(documents) != 1:
        raise ManifestError(f"{path} holds {len(documents)} YAML documents; expected exactly one GRPORun")
    manifest = documents[0]
    if not isinstance(manifest, dict):
        raise ManifestError(f"{path} must hold a mapping (a GRPORun), not a {type(manifest).__name__}")
    header = header_errors(manifest)
    if header:
        raise ManifestError(f"{path}: {header[0]}")
    return manifest


def header_errors(manifest: dict[str, Any]) -> list[str]:
    crd = load_crd()
    errors = []
    if manifest.get("apiVersion") != crd.api_version:
        errors.append(f"apiVersion: must be {crd.api_version}, not {manifest.get('apiVersion')!r}")
    if manifest.get("kind") != crd.kind:
        errors.append(f"kind: must be {crd.kind}, not {manifest.get('kind')!r}")
    metadata = manifest.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    if name is None:
        errors.append("metadata.name: required field is missing")
    elif not isinstance(name, str) or not name:
        errors.append(f"metadata.name: must be a non-empty string, not {name!r}")
    return errors


# --------------------------------------------------------------------------------------------------------------------
# Structural walk: unknown fields, nulls, defaults
# --------------------------------------------------------------------------------------------------------------------
def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _preserves_unknown(schema: dict[str, Any]) -> bool:
    return bool(schema.get("x-kubernetes-preserve-unknown-fields")) and "properties" not in schema


def _children(value: Any, schema: dict[str, Any], path: str) -> Iterator[tuple[Any, dict[str, Any], str, str | int]]:
    """(child value, child schema, child path, key or index) for the declared children of a node, as the API server
    walks them."""
    if isinstance(value, dict) and "properties" in schema:
        for key, child_schema in schema["properties"].items():
            if key in value:
                yield value[key], child_schema, _join(path, key), key
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, child in value.items():
            yield child, schema["additionalProperties"], _join(path, str(key)), key
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, child in enumerate(value):
            yield child, schema["items"], f"{path}[{index}]", index


def unknown_field_errors(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    if _preserves_unknown(schema):
        return []
    errors = []
    # A node with declared properties that also preserves unknown fields (a core/v1 Volume: `name` declared for the
    # CEL rules, its source free-form) reports nothing unknown at its own level; its declared children are checked.
    if isinstance(value, dict) and "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        known = list(schema["properties"])
        for key in value:
            if key not in schema["properties"]:
                guess = difflib.get_close_matches(str(key), known, n=1)
                hint = f" (did you mean {guess[0]}?)" if guess else f" (known: {', '.join(known)})"
                errors.append(f"{_join(path, str(key))}: unknown field{hint}")
    for child, child_schema, child_path, _ in _children(value, schema, path):
        errors.extend(unknown_field_errors(child, child_schema, child_path))
    return errors


def _drop_nulls_and_default(value: Any, schema: dict[str, Any]) -> None:
    """In place: nulls of non-nullable fields are pruned, then absent fields take their default, then children."""
    if _preserves_unknown(schema):
        return
    if isinstance(value, dict) and "properties" in schema:
        for key, child_schema in schema["properties"].items():
            if key in value and value[key] is None and not child_schema.get("nullable"):
                del value[key]
            if key not in value and "default" in child_schema:
                value[key] = copy.deepcopy(child_schema["default"])
    for child, child_schema, _, _ in _children(value, schema, ""):
        _drop_nulls_and_default(child, child_schema)


def with_defaults(manifest: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of the manifest as the API server would store it: nulls pruned, schema defaults applied."""
    defaulted = copy.deepcopy(manifest)
    _drop_nulls_and_default(defaulted, load_crd().schema)
    return defaulted


# --------------------------------------------------------------------------------------------------------------------
# Types and ranges (jsonschema), worded for people
# --------------------------------------------------------------------------------------------------------------------
_JSON_TYPE_NAMES = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
                    "object": "a mapping", "array": "a list"}


def _got(instance: Any) -> str:
    if isinstance(instance, (dict, list)):
        return f"a {'mapping' if isinstance(instance, dict) else 'list'}"
    return repr(instance)


def _schema_error_line(error: jsonschema.ValidationError, prefix: str) -> list[str]:
    path = prefix
    for part in error.absolute_path:
        path = f"{path}[{part}]" if isinstance(part, int) else _join(path, part)
    keyword, expected, instance = error.validator, error.validator_value, error.instance
    if keyword == "required":
        return [f"{_join(path, name)}: required field is missing" for name in expected if name not in instance]
    if keyword == "type":
        message = f"must be {_JSON_TYPE_NAMES.get(expected, expected)}, not {_got(instance)}"
    elif keyword == "enum":
        message = f"must be one of {', '.join(map(str, expected))}, not {_got(instance)}"
    elif keyword in ("minimum", "maximum"):
        exclusive = error.schema.get(f"exclusive{keyword.capitalize()}") is True
        operator = (">" if keyword == "minimum" else "<") + ("" if exclusive else "=")
        message = f"must be {operator} {expected}, not {instance!r}"
    elif keyword == "minItems":
        message = f"must list at least {expected} item{'s' if expected != 1 else ''}"
    elif keyword == "maxItems":
        message = f"must list at most {expected} items, not {len(instance)}"
    elif keyword == "minLength":
        message = "must not be empty" if expected == 1 else f"must be at least {expected} characters long"
    elif keyword == "maxProperties":
        message = f"must set at most {expected} entries, not {len(instance)}"
    elif keyword == "maxLength":
        message = f"must be at most {expected} characters long, not {len(instance)}"
    elif error.schema.get("x-kubernetes-int-or-string"):
        message = f"must be a quantity like 4, 500m or 16Gi, not {_got(instance)}"
    elif keyword == "pattern":
        message = f"must match {expected}, not {instance!r}"
    else:
        message = error.message
    return [f"{path or '<manifest>'}: {message}"]


@functools.cache
def _validator(*schema_path: str) -> jsonschema.Draft4Validator:
    schema = load_crd().schema
    for key in schema_path:
        schema = schema["properties"][key]
    return jsonschema.Draft4Validator(schema)


def schema_errors(value: Any, *schema_path: str) -> list[str]:
    """Type/range errors of the value at `schema_path` in the CRD schema (the whole object when empty)."""
    errors = sorted(_validator(*schema_path).iter_errors(value),
                    key=lambda error: [str(p) for p in error.absolute_path])
    return [line for error in errors for line in _schema_error_line(error, ".".join(schema_path))]


# --------------------------------------------------------------------------------------------------------------------
# CEL rules
# --------------------------------------------------------------------------------------------------------------------
@functools.cache
def _cel_program(rule: str) -> celpy.Runner:
    environment = celpy.Environment()
    return environment.program(environment.compile(rule))


# Property names CEL cannot select by their own name: Kubernetes exposes them to rules as `__word__`
# (k8s.io/apiserver's CEL field escaping; e.g. a field `function` is `self.__function__`).
CEL_RESERVED = frozenset({"true", "false", "null", "in", "as", "break", "const", "continue", "else", "for", "function",
                          "if", "import", "let", "loop", "package", "namespace", "return", "var", "void", "while"})


def cel_field_name(name: str) -> str:
    """The name a rule uses for the object property `name`, escaped as the API server escapes it."""
    if name in CEL_RESERVED:
        return f"__{name}__"
    escaped = name.replace("__", "__underscores__")
    for char, word in ((".", "__dot__"), ("-", "__dash__"), ("/", "__slash__")):
        escaped = escaped.replace(char, word)
    return escaped


def to_cel(value: Any, schema: dict[str, Any]) -> celtypes.Value:
    """Typed by the schema, as Kubernetes does: a `number` field holding 1 is the double 1.0 (cel-python's plain JSON
    conversion would make it an int, and `int > double` has no overload in CEL)."""
    if value is None or _preserves_unknown(schema) or not schema:
        return celpy.json_to_cel(value)
    kind = schema.get("type")
    if kind == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return celtypes.DoubleType(float(value))
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else {}
        return celtypes.MapType({
            celtypes.StringType(cel_field_name(key) if key in properties else key):
                to_cel(child, properties.get(key, extra))
            for key, child in value.items()
        })
    if isinstance(value, list):
        return celtypes.ListType([to_cel(child, schema.get("items", {})) for child in value])
    return celpy.json_to_cel(value)


@dataclass(frozen=True)
class RuleResult:
    path: str  # where the rule sits (spec.rewards[0]); fieldPath already appended
    rule: str
    message: str
    passed: bool
    evaluation_error: str | None = None

    @property
    def line(self) -> str:
        if self.evaluation_error is not None:
            return f"{self.path or '<manifest>'}: rule {self.rule!r} could not be evaluated: {self.evaluation_error}"
        return f"{self.path}: {self.message}" if self.path else self.message


_ABSENT = object()
_OLD_SELF = re.compile(r"\boldSelf\b")


def is_transition_rule(rule: dict[str, Any]) -> bool:
    """A rule reading `oldSelf` judges an update; the API server skips it on create and where no old value exists."""
    return bool(_OLD_SELF.search(rule["rule"]))


def evaluate_rule(rule: dict[str, Any], value: Any, schema: dict[str, Any], path: str,
                  old: Any = _ABSENT) -> RuleResult:
    # A rule on the root names its field without the leading dot the API server's fieldPath syntax needs.
    where = (path + rule.get("fieldPath", "")).removeprefix(".")
    message = rule.get("message") or f"failed rule: {rule['rule']}"
    activation = {"self": to_cel(value, schema)}
    if old is not _ABSENT:
        activation["oldSelf"] = to_cel(old, schema)
    try:
        outcome = _cel_program(rule["rule"]).evaluate(activation)
    except celpy.CELEvalError as error:
        outcome = error
    if isinstance(outcome, celpy.CELEvalError):
        return RuleResult(where, rule["rule"], message, False, str(outcome.args[0] if outcome.args else outcome))
    return RuleResult(where, rule["rule"], message, bool(outcome))


@dataclass(frozen=True)
class RuleSite:
    rule: dict[str, Any]
    value: Any  # what `self` is bound to
    schema: dict[str, Any]
    path: str
    keys: tuple[str | int, ...]  # from the root, to find the old value of an update at the same place


def rule_sites(value: Any, schema: dict[str, Any], path: str = "", keys: tuple = ()) -> Iterator[RuleSite]:
    """Every x-kubernetes-validations rule that applies to the value, with what `self` is there."""
    if value is None:
        return
    for rule in schema.get("x-kubernetes-validations", []):
        yield RuleSite(rule, value, schema, path, keys)
    if not _preserves_unknown(schema):
        for child, child_schema, child_path, key in _children(value, schema, path):
            yield from rule_sites(child, child_schema, child_path, (*keys, key))


def old_value(old_root: Any, keys: tuple[str | int, ...]) -> Any:
    """The old object's value at `keys`, or _ABSENT. Only object fields correlate: as in the API server, a list
    item has no old self (the lists here are atomic)."""
    node = old_root
    for key in keys:
        if isinstance(key, int) or not isinstance(node, dict) or key not in node:
            return _ABSENT
        node = node[key]
    return node


def cel_results(value: Any, schema: dict[str, Any], old: Any = _ABSENT) -> list[RuleResult]:
    """Every rule that applies to the (defaulted) value, evaluated; transition rules only for an update (`old` is
    the stored object) and only where the old object has a value."""
    results = []
    for site in rule_sites(value, schema):
        if not is_transition_rule(site.rule):
            results.append(evaluate_rule(site.rule, site.value, site.schema, site.path))
        elif (previous := old_value(old, site.keys) if old is not _ABSENT else _ABSENT) is not _ABSENT:
            results.append(evaluate_rule(site.rule, site.value, site.schema, site.path, previous))
    return results


# --------------------------------------------------------------------------------------------------------------------
# The whole check
# --------------------------------------------------------------------------------------------------------------------
def validate_manifest(manifest: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """All problems with a GRPORun manifest, one line each, naming the field; [] when the API server would admit it.

    Validates the defaulted form (see `with_defaults`), as the API server does; the manifest is not modified. With
    `old` (the run as stored), it is judged as an update of it: transition rules (immutable fields) apply too.
    """
    if not isinstance(manifest, dict):
        return [f"<manifest>: must be a mapping (a GRPORun), not {_got(manifest)}"]
    schema = load_crd().schema
    errors = header_errors(manifest) + unknown_field_errors(manifest, schema)
    defaulted = with_defaults(manifest)
    errors += schema_errors(defaulted)
    for result in cel_results(defaulted, schema, _ABSENT if old is None else with_defaults(old)):
        # A rule that cannot be evaluated on a value of the wrong type is noise next to the type error itself; with
        # a schema-valid manifest it would be a bug in the CRD, so it is reported then.
        if not result.passed and (result.evaluation_error is None or not errors):
            errors.append(result.line)
    return errors


@dataclass(frozen=True)
class GRPORun:
    """A validated, defaulted GRPORun read from a file: what `grporun local` and `grporun render` start from."""

    name: str
    namespace: str
    spec: GRPORunSpec
    manifest: dict[str, Any]


def read_grporun(path: str | os.PathLike[str], default_namespace: str = "default") -> GRPORun:
    """Load, validate and default a manifest; raises ManifestError (unreadable) or ManifestInvalid (one line each)."""
    manifest = load_manifest(path)
    errors = validate_manifest(manifest)
    if errors:
        raise ManifestInvalid(errors)
    defaulted = with_defaults(manifest)
    try:
        spec = parse_spec(defaulted["spec"])
    except SpecError as error:
        raise ManifestInvalid([str(error)]) from None
    metadata = defaulted["metadata"]
    return GRPORun(metadata["name"], metadata.get("namespace") or default_namespace, spec, defaulted)


# --------------------------------------------------------------------------------------------------------------------
# Warnings: valid, and the API server admits it, but a cluster run would likely not do what the author meant
# --------------------------------------------------------------------------------------------------------------------
#: Paths only `grporun local` can resolve: relative to the manifest's folder, or to a home directory.
MACHINE_LOCAL_PREFIXES = ("./", "../", "~")


def cluster_warnings(spec: GRPORunSpec) -> list[str]:
    """One line per warning, naming the field: what `grporun validate` reports and `--strict` refuses."""
    warnings = unkept_work(spec)
    paths = [("spec.model", spec.model), ("spec.dataset.path", spec.dataset.path)]
    paths += [(f"spec.rewards[{index}].model", reward.model) for index, reward in enumerate(spec.rewards)]
    for field_name, value in paths:
        if value is not None and value.startswith(MACHINE_LOCAL_PREFIXES):
            warnings.append(f"{field_name}: {value} is a path on this machine: only grporun local resolves it; a "
                            "cluster's pods need a hub id or a path on a volume they mount")
    return warnings
