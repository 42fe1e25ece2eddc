"""Object store locations (`s3://bucket/prefix`) and the variables that say where and as whom, without the client
library: the operator checks spec.output.uri and sets the variables with it; grpo_trainer.storage.object_store reads
and writes the locations. The CRD holds `parse_uri`'s rule again in CEL, on every field that takes an s3:// URI, so
the API server refuses what this module would (tests/crds/test_store_uri_rule.py keeps the two the same)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .codes import EXPORT_MANIFEST_FILE

SCHEME = "s3://"
# The variables boto3 reads (the operator sets them on the pod that uploads, from spec.output; grporun local passes
# its own environment on), the first of each tuple the one the operator sets.
ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
ACCESS_KEY_ENV = "AWS_ACCESS_KEY_ID"
SECRET_KEY_ENV = "AWS_SECRET_ACCESS_KEY"
SESSION_TOKEN_ENV = "AWS_SESSION_TOKEN"
REGION_ENV = ("AWS_REGION", "AWS_DEFAULT_REGION")
#: S3's bucket naming rules: 3-63 characters, lowercase letters, digits, dots and hyphens, a letter or digit at
#: both ends.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class InvalidObjectStoreURI(ValueError):
    """A URI that is not `s3://bucket[/prefix]`; the message names the field it came from, `reason` is the rest."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.reason = reason


@dataclass(frozen=True)
class Location:
    """`s3://bucket/prefix`: the prefix without slashes at its ends, "" for the whole bucket."""

    bucket: str
    prefix: str = ""

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    @property
    def manifest_key(self) -> str:
        return self.key(EXPORT_MANIFEST_FILE)


def parse_uri(uri: str, field: str) -> Location:
    """The location `uri` names; InvalidObjectStoreURI naming `field` when it is not `s3://bucket[/prefix]`."""
    def refuse(why: str) -> InvalidObjectStoreURI:
        return InvalidObjectStoreURI(field, f"{uri!r} is not an object store URI: {why}")

    if not isinstance(uri, str):
        raise refuse("not a string")
    scheme, separator, rest = uri.partition("://")
    if not separator or scheme != "s3":
        raise refuse("it must start with s3://")
    if any(character in rest for character in "?#\\") or any(ord(character) < 0x20 for character in rest):
        raise refuse("no query, fragment, backslash or control character is allowed")
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise refuse(f"{bucket!r} is not a bucket name (3-63 lowercase letters, digits, dots and hyphens)")
    prefix = prefix.rstrip("/")
    if prefix:
        parts = prefix.split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise refuse("the prefix has an empty, '.' or '..' segment")
    return Location(bucket, prefix)


def is_object_store_uri(uri: str) -> bool:
    """Whether `uri` names an object store location (its scheme; parse_uri checks the rest)."""
    return uri.startswith(SCHEME)


def is_hub_id(model: str) -> bool:
    """A model or dataset named as a hub repository: neither an object-store URI nor a path."""
    return not is_object_store_uri(model) and not model.startswith(("/", ".", "~"))
