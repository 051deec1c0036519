"""An epoch's mesh identity and its signed, single-use, expiring join keys (G9)."""

from libs.mesh.joinkeys import MeshIdentity, verify_join_key

__all__ = ["MeshIdentity", "verify_join_key"]
