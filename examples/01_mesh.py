"""Learning path 1: a mesh names the axes; each axis gives one process group per slice of the others.

Run: python examples/01_mesh.py   (no processes start: MeshLayout is the rank arithmetic Mesh uses)
"""

from polyshard.mesh import MeshLayout


def main() -> None:
    layout = MeshLayout({"pp": 2, "dp": 2, "tp": 2})  # 8 ranks, outermost first: tp varies fastest
    print("rank  " + " ".join(f"{r:>2}" for r in range(layout.size())))
    for axis in ("pp", "dp", "tp"):
        print(f"{axis:<5} " + " ".join(f"{layout.coords(r)[axis]:>2}" for r in range(layout.size())))
    for axes in ("tp", "dp", "pp", ("dp", "tp")):
        name = " x ".join(axes) if isinstance(axes, tuple) else axes
        print(f"{name} groups: {layout.groups(axes)}")
    hybrid = MeshLayout({"dp_replicate": 2, "dp_shard": 2, "tp": 2})  # hybrid sharding splits dp in two
    print(f"dp_shard groups: {hybrid.groups('dp_shard')}  dp groups: {hybrid.groups('dp')}")


if __name__ == "__main__":
    main()
