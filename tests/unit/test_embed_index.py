import pytest

from epdq.embed_index import EmbedIndex
from epdq.protocol import EmbedRef, EntryId


def ref(key: bytes, encoder: str = "enc-0", nbytes: int = 100, gen: int = 1) -> EmbedRef:
    return EmbedRef(key, encoder, "n0", "seg", 64, nbytes, gen, "float32", [1, 25], [1, 2, 2], "")


def test_books_follow_add_pin_unpin_drop():
    ix = EmbedIndex()
    a = ix.add(ref(b"a", nbytes=100), pinned=True)
    ix.add(ref(b"b", nbytes=50), pinned=False)
    ix.add(ref(b"c", "enc-1", nbytes=7, gen=9), pinned=False)
    assert (len(ix), ix.nbytes, ix.pinned) == (3, 157, 1)
    assert sorted(ix.keys_of("enc-0")) == [b"a", b"b"] and ix.keys_of("enc-1") == [b"c"]
    assert ix.pin(a) is False and ix.pinned == 1  # already pinned: nothing to tell the encoder
    assert ix.unpin(a) is True and ix.unpin(a) is False and ix.pinned == 0
    assert ix.pin(ix[b"c"]) is True and ix[b"c"].entry_id() == EntryId(b"c", 9)
    assert ix.drop(b"c").pinned and ix.pinned == 0 and ix.nbytes == 150
    assert ix.keys_of("enc-1") == [] and "enc-1" not in ix._by_encoder  # no empty set left behind
    assert b"c" not in ix and ix.get(b"c") is None and sorted(ix) == [b"a", b"b"]


def test_a_resident_key_is_not_added_twice_and_an_absent_one_not_dropped():
    ix = EmbedIndex()
    ix.add(ref(b"a"), pinned=True)
    with pytest.raises(KeyError):
        ix.add(ref(b"a", "enc-1"), pinned=False)
    with pytest.raises(KeyError):
        ix.drop(b"zz")
    assert (len(ix), ix.nbytes, ix.pinned, ix.keys_of("enc-1")) == (1, 100, 1, [])


def test_keys_of_is_a_copy_safe_to_drop_from():
    ix = EmbedIndex()
    for k in (b"a", b"b", b"c"):
        ix.add(ref(k), pinned=False)
    for k in ix.keys_of("enc-0"):
        ix.drop(k)
    assert len(ix) == 0 and ix.nbytes == 0
