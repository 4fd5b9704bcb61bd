"""The claim a run makes on an object store output it writes (`.metadata.tmp` holding the run's
token, as a save in progress holds), as each process writing for that run checks it before it
starts and before it completes each file (ObjectOutputFile). ObjectStoreOutput (staging.py)
makes it and gives it up."""

from __future__ import annotations

from dataclasses import dataclass

from dcpctl.errors import OutputTakenError
from dcpctl.storage.objects import ObjectChangedError, ObjectPath


@dataclass(frozen=True)
class OutputClaim:
    """An object store output's claim: picklable, to go to workers and torchrun ranks.
    takes_over: the run was given --overwrite, so objects another run leaves under the output
    are this run's to delete while it holds the claim."""

    path: ObjectPath
    data: bytes
    takes_over: bool = False

    def is_held(self) -> bool:
        """Whether the claim is still this run's: a run with --overwrite deletes it as it takes
        the output over, and puts its own in its place."""
        try:
            return self.path.read_bytes() == self.data
        except (FileNotFoundError, ObjectChangedError):
            return False

    def check(self) -> None:
        """Before a file of the output is started, and before it is completed: raise
        OutputTakenError, naming the output, where another run took it over, so that this one
        puts nothing more among that run's files. An object it completed all the same (the
        takeover came between the check and the completion) stays for that run to delete
        (ObjectStoreOutput.confirm, clear_name): this run cannot delete it, since an object of
        its own cannot be told from one of the same bytes that run wrote in its place, their
        ETags alike."""
        if not self.is_held():
            raise OutputTakenError("another run took this output over while this one wrote it "
                                   "(--overwrite?): nothing was published",
                                   path=self.path.parent)

    def clear_name(self, path: ObjectPath) -> bool:
        """After this run's write of path was refused because an object has its name: where
        this run took the output over and still holds it, that object is one the run taken
        over completed after the takeover cleared the output (its upload was on its way):
        delete it, as listed now, and return True, for the write to be completed again.
        False where the object is not this run's to delete."""
        if not self.takes_over:
            return False
        store = path.store
        standing = store.info_now(path.key)
        # Seen first, then the claim checked: a run that takes the output over from this one in
        # between deletes the object seen with the rest, and writes one of its own under that
        # name only once it has claimed the output and read its source, long after the delete
        # below (one request later, and conditional on the ETag seen where the store honours it).
        if not self.is_held():
            return False
        if standing is not None:
            store.delete([path.key], if_etags={path.key: standing.etag})
        return True


__all__ = ["OutputClaim"]
