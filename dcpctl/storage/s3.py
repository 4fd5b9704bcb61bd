"""S3 and S3-compatible stores, through s3fs's client: reads pinned to the object first seen
(If-Match on its ETag), conditional creates and replaces (If-None-Match / If-Match), parallel
multipart uploads, and every failure worded as one line.

Credentials and endpoints come the way boto finds them: the environment, `~/.aws`, an instance
role; `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` for an S3-compatible store. Storage options
(DCPCTL_STORAGE_OPTIONS, --storage-option) go to s3fs.S3FileSystem as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import importlib
import os
import threading
from typing import Callable, Iterator, Mapping

from dcpctl.errors import DcpctlError, name_and_message
from dcpctl.storage.objects import ObjectChangedError, ObjectStore, ObjectWriter, StorageError

PART_BYTES = 8 << 20
"""Bytes of each of the first parts of a multipart upload (S3 wants at least 5 MiB but for the
last)..."""
PARTS_PER_SIZE_STEP = 1000
"""...and every PARTS_PER_SIZE_STEP parts, parts grow by PART_BYTES: an object's size is not
known while it is written, and S3 takes at most 10,000 parts (up to 430 GiB this way)."""
PARTS_IN_FLIGHT = 6
"""Parts uploading at once across every object being written, each held in memory (twice:
botocore hands aiohttp a copy) until done; a writer with a part ready waits for a slot."""
_PART_SLOTS = threading.BoundedSemaphore(PARTS_IN_FLIGHT)
_DELETE_BATCH_KEYS = 1000  # the most one DeleteObjects takes
_CONDITION_NOT_TAKEN = ("MalformedXML", "NotImplemented", "InvalidArgument", "InvalidRequest")
"""What an S3-compatible store that does not know DeleteObjects' ETag condition may answer."""


_READ_ATTEMPTS = 3
"""GETs of a ranged read whose answer was cut short (botocore retries each until its answer
begins)."""


def new_s3_store(protocol: str, options: dict[str, object]) -> S3Store:
    """An S3 store configured from the environment and the storage options."""
    try:
        s3fs = importlib.import_module("s3fs")
    except ImportError:
        raise DcpctlError(f"{protocol}:// URLs need s3fs: pip install 'dcpctl[s3]'") from None
    options = dict(options)
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "endpoint_url" not in options:
        options["endpoint_url"] = endpoint
    config = {"retries": {"mode": "standard", "max_attempts": 8},
              # a ranged GET cannot be checked against the whole object's checksum, which
              # some S3-compatible servers send with it anyway
              "response_checksum_validation": "when_required",
              **dict(options.pop("config_kwargs", None) or {})}
    try:
        filesystem = s3fs.S3FileSystem(config_kwargs=config, skip_instance_cache=True,
                                       **options)
        _check_session_options(filesystem.kwargs)
        # botocore retries each request (throttling, 5xx, dropped connections, timeouts):
        # s3fs's own loop around it, 5 tries, would multiply its attempts
        filesystem.retries = 1
        filesystem.connect()  # the client, made of the options (no request sent yet)
    except (TypeError, ValueError) as error:
        raise DcpctlError(f"cannot open {protocol}:// URLs with these storage options: "
                          f"{error}") from None
    return S3Store(protocol, filesystem)


def _check_session_options(options: dict[str, object]) -> None:
    """Raise TypeError now for options S3FileSystem does not take itself: it hands them to
    the botocore session it makes at the first request, which would fail there instead."""
    import inspect

    from aiobotocore.session import AioSession
    accepted = set(inspect.signature(AioSession.__init__).parameters) - {"self"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise TypeError(f"unknown option {', '.join(map(repr, unknown))} (s3fs.S3FileSystem "
                        f"takes: endpoint_url, key, secret, client_kwargs, config_kwargs, ...)")


class S3Store(ObjectStore):
    """An S3 bucket (see module docstring)."""

    def __init__(self, protocol: str, filesystem) -> None:
        super().__init__(protocol, filesystem)
        self._open_uploads: dict[str, str] = {}  # upload id -> key: started, not yet ended
        self._open_uploads_lock = threading.Lock()

    def note_upload(self, key: str, upload_id: str, is_open: bool) -> None:
        """Keep track of the uploads this process has open (abort_open_uploads)."""
        with self._open_uploads_lock:
            if is_open:
                self._open_uploads[upload_id] = key
            else:
                self._open_uploads.pop(upload_id, None)

    def abort_open_uploads(self, prefix: str) -> None:
        base = prefix.rstrip("/")
        with self._open_uploads_lock:
            ours = {upload_id: key for upload_id, key in self._open_uploads.items()
                    if not base or key == base or key.startswith(base + "/")}
        for upload_id, key in ours.items():
            try:
                self._call(key, "abort_multipart_upload", UploadId=upload_id)
            except Exception:  # noqa: BLE001 - housekeeping after the failure being reported
                continue
            self.note_upload(key, upload_id, is_open=False)

    def _call(self, key: str, method: str, **arguments):
        """Run an S3 call on s3fs's event loop (with its retries); raise ClientError as is."""
        bucket, object_key, _ = self.fs.split_path(key)
        return self._run(self.fs._call_s3(method, Bucket=bucket, Key=object_key, **arguments))

    def _run(self, coroutine):
        from fsspec.asyn import sync
        return sync(self.fs.loop, _awaited, coroutine)

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """One ranged GET, If-Match on the ETag first seen (and the answer's ETag compared,
        for servers that ignore If-Match), made again (at most _READ_ATTEMPTS in all) where
        its transfer is cut short: botocore retries a request until its answer begins."""
        if end <= start:
            return b""
        from s3fs.core import S3_RETRYABLE_ERRORS
        bucket, object_key, _ = self.fs.split_path(key)
        etag = self.remembered_etag(key)
        condition = {"IfMatch": f'"{etag}"'} if etag else {}

        async def get() -> bytes:
            for attempt in range(_READ_ATTEMPTS):
                try:  # the request, retried by botocore until its answer begins
                    response = await self.fs._call_s3(
                        "get_object", Bucket=bucket, Key=object_key,
                        Range=f"bytes={start}-{end - 1}", **condition)
                except Exception as error:  # noqa: BLE001 - worded below, or re-raised
                    if _code_of(error) == "InvalidRange":
                        return b""  # starts at or past the end: the caller sees a short read
                    raise
                try:
                    returned = str(response.get("ETag") or "").strip('"')
                    if etag and returned and returned != etag:
                        raise _changed_error()
                    return await response["Body"].read()
                except (*S3_RETRYABLE_ERRORS, asyncio.TimeoutError):  # the answer cut short
                    if attempt + 1 == _READ_ATTEMPTS:
                        raise
                    await asyncio.sleep(0.1 * 2 ** attempt)
                finally:
                    response["Body"].close()

        with self.translated_errors(key):
            return self._run(get())

    def put(self, key: str, data: bytes, if_absent: bool = False,
            if_etag: str | None = None) -> None:
        condition = {}
        if if_absent:
            condition["IfNoneMatch"] = "*"
        elif if_etag is not None:
            condition["IfMatch"] = f'"{if_etag}"'
        with _exists_when_refused(self.url(key), if_absent), self.translated_errors(key):
            if condition:  # asked first too, for the servers that ignore the condition
                self.refuse_unmet_condition(key, if_absent, if_etag)
            response = self._call(key, "put_object", Body=bytes(data), **condition)
        self.note_written(key, response.get("ETag"))

    def note_written(self, key: str, etag: str | None = None) -> None:
        super().note_written(key, etag)
        self.fs.invalidate_cache(key)

    def why_absent(self, key: str) -> str:
        bucket, _, _ = self.fs.split_path(key)
        try:
            self._run(self.fs._call_s3("head_bucket", Bucket=bucket))
        except Exception as error:  # noqa: BLE001 - only a bucket known absent says more
            if isinstance(error, FileNotFoundError) or _code_of(error) in (
                    "404", "NoSuchBucket", "NotFound"):
                return "no such bucket"
        return super().why_absent(key)

    def delete(self, keys: list[str], if_etags: Mapping[str, str | None] | None = None) -> None:
        """DeleteObjects, a batch of up to 1,000 literal keys of one bucket at a time, each
        with the ETag if_etags gives it (servers that know the condition refuse the deletion
        of an object replaced since). S3 answers a batch with 200 whatever became of each key:
        the errors it lists are raised, the first named."""
        if_etags = if_etags or {}
        batches: dict[str, list[tuple[str, str]]] = {}
        for key in keys:
            bucket, object_key, _ = self.fs.split_path(key)
            batches.setdefault(bucket, []).append((key, object_key))
        for bucket, batch in batches.items():
            for start in range(0, len(batch), _DELETE_BATCH_KEYS):
                self._delete_batch(bucket, batch[start:start + _DELETE_BATCH_KEYS], if_etags)

    def _delete_batch(self, bucket: str, batch: list[tuple[str, str]],
                      if_etags: Mapping[str, str | None]) -> None:
        try:
            response = self._delete_objects(bucket, batch, if_etags)
        except StorageError:
            # The store may have deleted them and its answer been lost on the way (a connection
            # reset, a timeout): a deletion failed only where an object is still there.
            if any(self.info_now(key) is not None for key, _ in batch):
                raise
            return
        failed = [error for error in response.get("Errors") or ()
                  if error.get("Code") != "NoSuchKey"]
        if failed:
            first = failed[0]
            code = first.get("Code")
            reason = ("it changed since dcpctl first saw it"
                      if code in ("PreconditionFailed", "412")
                      else f"S3 error {code}: {first.get('Message')}")
            raise StorageError(f"was not deleted ({reason})"
                               + (f"; nor were {len(failed) - 1} more" if len(failed) > 1 else ""),
                               path=self.url(f"{bucket}/{first.get('Key')}"))

    def _delete_objects(self, bucket: str, batch: list[tuple[str, str]],
                        if_etags: Mapping[str, str | None]) -> dict:
        objects = []
        for key, object_key in batch:
            self.forget(key)
            etag = if_etags.get(key)
            objects.append({"Key": object_key, **({"ETag": f'"{etag}"'} if etag else {})})
        with self.translated_errors(batch[0][0]):
            try:
                response = self._run(self.fs._call_s3(
                    "delete_objects", Bucket=bucket, Delete={"Objects": objects, "Quiet": True}))
            except Exception as error:  # noqa: BLE001 - a store that will not take ETags here
                if _code_of(error) not in _CONDITION_NOT_TAKEN or not if_etags:
                    raise
                plain = [{"Key": item["Key"]} for item in objects]  # callers checked before
                response = self._run(self.fs._call_s3(
                    "delete_objects", Bucket=bucket, Delete={"Objects": plain, "Quiet": True}))
            finally:
                for key, _ in batch:
                    self.note_written(key)
        return response

    def open_writer(self, key: str, if_absent: bool = False) -> ObjectWriter:
        return MultipartWriter(self, key, if_absent)

    def abort_uploads(self, prefix: str, wanted: Callable[[str], bool] = lambda name: True,
                      written_before: float | None = None) -> list[str]:
        """Abort the multipart uploads under prefix/ whose names are wanted, and, given
        written_before, that were started, and given their last part, before it: a killed
        process's, whose parts S3 keeps (and bills, out of every listing) until they are
        aborted. Best effort: a store that will not list or abort them (rclone's) leaves them,
        and says nothing."""
        aborted = []
        try:
            for bucket, name, upload in self._uploads_under(prefix):
                if wanted(name) and (written_before is None
                                     or self._last_written(bucket, upload) < written_before):
                    self._run(self.fs._call_s3("abort_multipart_upload", Bucket=bucket,
                                               Key=upload["Key"], UploadId=upload["UploadId"]))
                    aborted.append(name)
        except Exception:  # noqa: BLE001 - housekeeping never fails the command it follows
            pass
        return aborted

    def unfinished_uploads(self, prefix: str) -> dict[str, float | None]:
        try:
            return {name: self._last_written(bucket, upload)
                    for bucket, name, upload in self._uploads_under(prefix)}
        except Exception:  # noqa: BLE001 - a store that lists none (rclone's) has none to say
            return {}

    def _uploads_under(self, prefix: str) -> Iterator[tuple[str, str, dict]]:
        """The unfinished uploads under prefix/: (bucket, name relative to prefix, upload)."""
        bucket, key, _ = self.fs.split_path(prefix)
        # its own `/`: s3fs before 2026.2 drops one given, which would take in step-100/ too
        key_prefix = key.rstrip("/") + "/" if key else ""
        for page in self._pages("list_multipart_uploads", lambda page: {
                "KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]},
                Bucket=bucket, Prefix=key_prefix):
            for upload in page.get("Uploads") or ():
                yield bucket, upload["Key"][len(key_prefix):], upload

    def _last_written(self, bucket: str, upload: dict) -> float:
        """When the upload was started or last given a part, in seconds since the epoch."""
        pages = self._pages("list_parts", lambda page: {
            "PartNumberMarker": page["NextPartNumberMarker"]},
            Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        return max([upload["Initiated"].timestamp(),
                    *(part["LastModified"].timestamp()
                      for page in pages for part in page.get("Parts") or ())])

    def _pages(self, method: str, next_markers: Callable[[dict], dict], **arguments
               ) -> Iterator[dict]:
        """The pages of a listing call, each asked from where the one before ended."""
        markers: dict = {}
        while True:
            page = self._run(self.fs._call_s3(method, **arguments, **markers))
            yield page
            if not page.get("IsTruncated"):
                return
            markers = next_markers(page)

    def describe(self, error: Exception) -> tuple[type[StorageError], str] | None:
        reason = self._reason(error)
        if reason is None:
            return None
        if _code_of(error) in ("PreconditionFailed", "412"):
            return ObjectChangedError, reason
        return StorageError, reason

    def _reason(self, error: Exception) -> str | None:
        botocore_exceptions = importlib.import_module("botocore.exceptions")
        if isinstance(error, botocore_exceptions.NoCredentialsError):
            return ("no AWS credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                    "or AWS_PROFILE, or run where an instance role gives them)")
        if isinstance(error, botocore_exceptions.EndpointConnectionError):
            # what botocore raises for a connection refused, and for one dropped mid-request
            return f"cannot connect to the S3 endpoint, or it kept dropping the connection: {error}"
        aiohttp = importlib.import_module("aiohttp")  # what a body cut short raises
        if isinstance(error, (botocore_exceptions.ConnectionError,
                              botocore_exceptions.HTTPClientError,
                              botocore_exceptions.ResponseStreamingError, aiohttp.ClientError)):
            return f"the connection kept failing after retries ({name_and_message(error)})"
        code = _code_of(error)
        if code in ("NoSuchBucket",):
            return "no such bucket"
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403",
                    "AllAccessDisabled"):
            return f"access denied ({code})"
        if code in ("PreconditionFailed", "412"):
            return ("the object changed while dcpctl read or replaced it (its ETag is not the "
                    "one first seen)")
        if code in ("SlowDown", "Throttling", "503", "RequestTimeout"):
            return f"the store kept refusing requests after retries ({code})"
        if code is not None:
            return f"S3 error {code}: {_message_of(error)}"
        if isinstance(error, botocore_exceptions.BotoCoreError):
            return name_and_message(error)
        return None


@contextlib.contextmanager
def _exists_when_refused(url: str, if_absent: bool) -> Iterator[None]:
    """A create refused because an object has the name raises FileExistsError."""
    try:
        yield
    except ObjectChangedError:
        if if_absent:
            raise FileExistsError(errno.EEXIST, "exists", url) from None
        raise


def _changed_error() -> Exception:
    """What a GET answered by another object than the one first seen raises (as S3 does for
    If-Match)."""
    botocore_exceptions = importlib.import_module("botocore.exceptions")
    return botocore_exceptions.ClientError(
        {"Error": {"Code": "PreconditionFailed", "Message": "ETag changed"}}, "GetObject")


async def _awaited(coroutine):
    return await coroutine


def _code_of(error: Exception) -> str | None:
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        if code is None:
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return None if status is None else str(status)
        return str(code)
    cause = error.__cause__ or error.__context__
    return _code_of(cause) if cause is not None and cause is not error else None


def _message_of(error: Exception) -> str:
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        return response.get("Error", {}).get("Message") or str(error)
    return str(error)


class MultipartWriter(ObjectWriter):
    """An object uploaded as parts of PART_BYTES and up, several at once (PARTS_IN_FLIGHT
    among all writers), while the caller goes on writing; completed (published) by finish(),
    only where no object has its name by then with if_absent; aborted by discard(). An object
    smaller than one part is one PUT."""

    def __init__(self, store: S3Store, key: str, if_absent: bool) -> None:
        self.store = store
        self.key = key
        self.if_absent = if_absent
        self._size = 0
        self._pending = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict] = []
        self._part_sizes: dict[int, int] = {}  # by part number
        self._in_flight: list = []

    def write(self, data) -> None:
        self._pending += data
        self._size += len(data)
        while len(self._pending) >= self._next_part_bytes():
            self._upload_part(self._next_part_bytes())

    def _next_part_bytes(self) -> int:
        parts_started = len(self._parts) + len(self._in_flight)
        return PART_BYTES * (1 + parts_started // PARTS_PER_SIZE_STEP)

    def _upload_part(self, part_bytes: int) -> None:
        """Start uploading the first part_bytes pending as the next part. Its slot is taken
        before the part is copied out: a writer waiting for one holds no copy, so no more than
        PARTS_IN_FLIGHT parts are held whatever the number of threads writing."""
        with self.store.translated_errors(self.key):
            if self._upload_id is None:
                response = self.store._call(self.key, "create_multipart_upload")
                self._upload_id = response["UploadId"]
                self.store.note_upload(self.key, self._upload_id, is_open=True)
        self._reap(block=False)
        _PART_SLOTS.acquire()
        try:
            with memoryview(self._pending) as pending, pending[:part_bytes] as head:
                part = bytes(head)
            del self._pending[:part_bytes]
            number = len(self._parts) + len(self._in_flight) + 1
            self._part_sizes[number] = len(part)
            bucket, object_key, _ = self.store.fs.split_path(self.key)
            coroutine = self.store.fs._call_s3("upload_part", Bucket=bucket, Key=object_key,
                                               UploadId=self._upload_id, PartNumber=number,
                                               Body=part)
            import asyncio  # here: s3fs brings its event loop; every command imports this

            future = asyncio.run_coroutine_threadsafe(coroutine, self.store.fs.loop)
        except BaseException:
            _PART_SLOTS.release()
            raise
        future.add_done_callback(lambda _: _PART_SLOTS.release())
        self._in_flight.append((number, future))

    def _reap(self, block: bool) -> None:
        still = []
        for number, future in self._in_flight:
            if block or future.done():
                with self._upload_still_open(), self.store.translated_errors(self.key):
                    response = future.result()
                self._parts.append({"PartNumber": number, "ETag": response["ETag"]})
            else:
                still.append((number, future))
        self._in_flight = still

    def finish(self) -> None:
        if self._upload_id is not None:
            if self._pending:
                self._upload_part(len(self._pending))
            self._reap(block=True)
            self._parts.sort(key=lambda part: part["PartNumber"])
        try:
            if self._upload_id is None:
                self.store.put(self.key, bytes(self._pending), if_absent=self.if_absent)
                return  # put kept the ETag
            self._complete()
        except Exception:
            # A reply lost after the store made the object (a dropped connection): the
            # client's retry is refused (the upload is done, or, if_absent, the name taken).
            if not self._made_as_written():
                raise
            etag = self.store.remembered_etag(self.key)  # as _made_as_written asked for it
        else:
            etag = self._listed_etag()
        self.store.note_upload(self.key, self._upload_id, is_open=False)  # completed
        self.store.note_written(self.key, etag)

    def _complete(self) -> None:
        condition = {"IfNoneMatch": "*"} if self.if_absent else {}
        with (_exists_when_refused(self.store.url(self.key), self.if_absent),
              self.store.translated_errors(self.key)):
            if self.if_absent:  # asked first too, for the servers that ignore the condition
                self.store.refuse_unmet_condition(self.key, True, None)
            with self._upload_still_open():
                self.store._call(self.key, "complete_multipart_upload",
                                 UploadId=self._upload_id, MultipartUpload={"Parts": self._parts},
                                 **condition)

    @contextlib.contextmanager
    def _upload_still_open(self) -> Iterator[None]:
        """A request on the upload answered NoSuchUpload (FileNotFoundError, as s3fs words it)
        is said as what it means."""
        try:
            yield
        except FileNotFoundError:
            raise StorageError("the store no longer holds the upload of its parts (aborted "
                               "meanwhile: by a lifecycle rule, or by a run that found it a "
                               "day old)", path=self.store.url(self.key)) from None

    def _listed_etag(self) -> str | None:
        """The completed object's ETag as a listing gives it (the completion's answer need not
        be: rclone's is the MD5 of the parts' MD5s, its listing's the MD5 of the object); None
        where the object there is not of the size written, or the store will not say (the
        write landed all the same: the output's checks then go by its size)."""
        try:
            info = self.store.info_now(self.key)
        except Exception:  # noqa: BLE001 - credentials that may write but not read
            return None
        return info.etag if info is not None and info.size == self._size else None

    def _made_as_written(self) -> bool:
        """After finish() failed: whether the object under the key, asked now, is the one this
        writer wrote all the same: its bytes (one PUT), or the ETag S3 gives an upload of
        these parts (the MD5 of their MD5s, and their count), or, where the store lists another
        kind of ETag (rclone's MD5 of the whole object), each part's bytes read back, a part at
        a time, against the MD5 its upload was answered with. False where the store will not
        say, or its parts' ETags are not their MD5s (SSE-KMS)."""
        if self._upload_id is None:
            return self.store.holds_exactly(self.key, bytes(self._pending)) is True
        try:
            info = self.store.info_now(self.key)
            if info is None or info.size != self._size:
                return False
            digests = [bytes.fromhex(part["ETag"].strip('"')) for part in self._parts]
            md5 = hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest()
            if info.etag == f"{md5}-{len(self._parts)}":
                return True
            start = 0
            for part, digest in zip(self._parts, digests):
                end = start + self._part_sizes[part["PartNumber"]]
                data = self.store.read_range(self.key, start, end)
                if hashlib.md5(data, usedforsecurity=False).digest() != digest:
                    return False
                start = end
            return start == self._size
        except Exception:  # noqa: BLE001 - the failed write is the error to report
            return False

    def discard(self) -> None:
        for _, future in self._in_flight:
            future.cancel()
        self._in_flight = []
        if self._upload_id is not None:
            try:
                self.store._call(self.key, "abort_multipart_upload", UploadId=self._upload_id)
                self.store.note_upload(self.key, self._upload_id, is_open=False)
            except Exception:  # noqa: BLE001 - the failure being handled is the one to report
                pass
            self._upload_id = None


__all__ = ["MultipartWriter", "S3Store", "StorageError", "new_s3_store"]
