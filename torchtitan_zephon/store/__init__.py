"""The on-disk token store: format, opening, reader, writer, group, upgrade.

Role: what a prepared corpus is on disk (``format``: file names, manifest,
fingerprints, checksums), how it is opened (``opening``: the manifest and checksums.bin
checked) and read (``reader.TokenStore``, memory-mapped and checked chunk by chunk),
written (``writer``: checksums, derived stores, slices), gathered across stores
(``group.StoreGroup``) and upgraded (``upgrade``).

Invariant: the bottom layer. Pure Python + numpy; imports nothing else of the
package (no ingest, order, job, torch.distributed or torchtitan). Import the
modules directly: this package re-exports nothing.

``reader.TokenStore.open`` opens local folders and, for an object-storage URL, hands
it to the subclass that reads by range (``remote.RemoteTokenStore``, declared with
``reads_object_urls=True``). The package imports ``remote`` here so that subclass is
always known, and ``reader`` never imports ``remote`` (which builds on it).
"""

from torchtitan_zephon.store import remote as _remote  # noqa: F401  (see above)
