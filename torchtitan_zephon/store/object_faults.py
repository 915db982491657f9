"""What a failed request to object storage means, said from the error's kind.

Role: ``request_failure`` turns obstore's exception into the StoreError a user reads:
a changed object (its ETag), a missing object or bucket, access denied, no
credentials (naming the variables looked for), an endpoint that does not answer or
fails (``_Unanswered``: it fails the other reads pending, ``location.ObjectFiles``),
or anything else with obstore's first line scrubbed.

Faults: transient failures (500/502/503/504, throttling, an attempt over its time
limit, a reset connection, a body cut short) are retried by obstore, with exponential
backoff and jitter, ``RETRIES`` times after the first attempt (obstore knows each
cloud's transient answers); a well-formed answer shorter than asked is retried here the
same number of times. What cannot get better by waiting stops at once with an error
naming the object and what to do: 403, a missing object or bucket, an object changed
since open (412 on ``If-Match``), missing credentials.

Secrets never reach a message: obstore's error texts (which print request URLs) are
not passed on; messages are written here from the error's kind, with URLs redacted
and the values of the secret variables scrubbed.

Invariant: no message holds a URL's query string or user info, a request URL, or the
value of a secret variable (``urls.redact`` / ``urls.scrub``).
"""

from __future__ import annotations

import asyncio
import re

from torchtitan_zephon.store.format import StoreError
from torchtitan_zephon.store.urls import CREDENTIAL_VARIABLES, ObjectURL, scrub


class MissingObject(StoreError):
    """An object (or its bucket) that does not exist."""


class _Unanswered(StoreError):
    """A request that failed on every attempt for want of a working endpoint (no answer,
    failing or throttling answers, a refused or reset connection): it fails the other
    reads pending (``ObjectFiles``)."""


def unanswered(error: BaseException) -> bool:
    """Whether ``error`` is a request that failed for want of a working endpoint (it then
    fails the other reads pending)."""
    return isinstance(error, _Unanswered)


class MissingBucket(MissingObject):
    """The bucket (container) itself does not exist."""


def request_failure(
    e: BaseException,
    url: ObjectURL,
    name: str,
    doing: str,
    *,
    opened: bool,
    timeout_s: float,
    retries: int,
) -> StoreError:
    """A StoreError for a failed request on the file ``name`` of ``url``, written here
    from the error's kind (``opened``: the file was there when the store was opened;
    ``doing``: "reading" or "writing"); obstore's own text, which prints request URLs,
    is never passed on but scrubbed."""
    from obstore.exceptions import (
        NotFoundError,
        PermissionDeniedError,
        PreconditionError,
        UnauthenticatedError,
    )

    where = url.child(name)
    text = str(e)
    retried = re.search(r"after (\d+) retries", text)
    attempts = int(retried.group(1)) + 1 if retried else 1
    variables = CREDENTIAL_VARIABLES[url.scheme]
    if isinstance(e, PreconditionError):
        return StoreError(
            f"{where} changed while this job reads it (its ETag is no longer the one "
            "recorded when the store was opened): a store must not be rewritten in "
            "place. Restart the job to read the new version; its fingerprint is checked."
        )
    if isinstance(e, (FileNotFoundError, NotFoundError)) or "NoSuchBucket" in text:
        if "NoSuchBucket" in text or "ContainerNotFound" in text:
            kind = "container" if url.scheme == "az" else "bucket"
            return MissingBucket(
                f"the {kind} of {url.shown} does not exist (or is not visible with "
                f"these credentials): check the URL, and AWS_ENDPOINT_URL for an "
                "S3-compatible endpoint."
            )
        if opened:  # it was there when the store was opened
            return MissingObject(
                f"{where} does not exist any more: it was deleted after the store was "
                "opened. Upload the whole store again (manifest.json last) and restart "
                "the job."
            )
        return MissingObject(f"{where} does not exist.")
    if isinstance(e, (PermissionDeniedError, UnauthenticatedError)) or " 403 " in text:
        return StoreError(
            f"access to {where} was denied (403): the credentials found do not allow "
            f"reading it. Grant them read access to the store's prefix, or give others "
            f"(looked for {variables})."
        )
    if "metadata" in text.lower() or "169.254.169.254" in text or "credential" in text.lower():
        return StoreError(
            f"no credentials to read {url.shown}: looked for {variables}, and found "
            "none that works."
        )
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)) or "kind: Timeout" in text:
        return _Unanswered(
            f"{doing} {where} took longer than request_timeout_s={timeout_s:g} s, "
            f"{retries + 1 if not retried else attempts} times (retried with backoff): "
            "the endpoint, or the credential source, does not answer. Check the network "
            "and the endpoint (AWS_ENDPOINT_URL for an S3-compatible one), and the "
            f"credentials: looked for {variables}; or raise zephon.request_timeout_s."
        )
    status = re.search(r"status code: (\d{3})", text)
    if status and status.group(1) == "416":  # a range past the end: a short object
        return StoreError(
            f"{where} is shorter than the store says: a read of it reached past its end "
            "(the endpoint answered 416 InvalidRange). Upload the store again "
            "(manifest.json last)."
        )
    if status:
        code = re.search(r"<Code>(\w+)</Code>", text)
        said = f"{status.group(1)} {code.group(1)}" if code else status.group(1)
        return _Unanswered(
            f"{doing} {where} failed {attempts} times (retried with backoff): the "
            f"endpoint answered {said}. The service is failing or throttling this job: "
            "try again later, or read less at once (lower zephon.read_ahead_steps)."
        )
    if "error sending request" in text or "body error" in text or "connection" in text.lower():
        return _Unanswered(
            f"{doing} {where} failed {attempts} times (retried with backoff): the "
            "connection was refused or reset, or an answer was cut short. Check the "
            "network and the endpoint (AWS_ENDPOINT_URL for an S3-compatible one)."
        )
    first = scrub(text.splitlines()[0] if text else type(e).__name__)
    first = re.sub(r"https?://\S+", "<endpoint>", first)
    return StoreError(f"{doing} {where} failed: {first}")
