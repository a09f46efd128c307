"""The radix tree behind `allocator=radix`: edges are runs of token pages,
nodes hold the KV blocks of their run (one block per page of `page_size`
tokens). A child is keyed by the first page of its run, so a lookup walks one
dict per node and compares pages along the edge; a match ends at any page
boundary, inside an edge too (`split` then cuts the edge there). Pure data: the
allocator owns the ref counts and decides what to insert and evict.
"""

from __future__ import annotations

from collections.abc import Iterator


class Node:
    __slots__ = ("key", "blocks", "children", "parent", "last_access")

    def __init__(self, key: tuple[int, ...], blocks: list[int], parent: Node | None) -> None:
        self.key = key  # the run's tokens, len(blocks) pages
        self.blocks = blocks
        self.children: dict[tuple[int, ...], Node] = {}  # first page of the child's run -> child
        self.parent = parent
        self.last_access = 0


class RadixTree:
    def __init__(self, page_size: int) -> None:
        self.page = page_size
        self.root = Node((), [], None)
        self.node_of_block: dict[int, Node] = {}
        self.clock = 0  # logical time of the latest access, for LRU eviction

    def match(self, tokens: list[int], limit: int) -> list[tuple[Node, int]]:
        """The longest page-aligned prefix of `tokens[:limit]` in the tree, as
        the path of (node, pages of it matched); only the last may be partial."""
        page, node, pos = self.page, self.root, 0
        path: list[tuple[Node, int]] = []
        while pos + page <= limit:
            child = node.children.get(tuple(tokens[pos : pos + page]))
            if child is None:
                break
            pages = 0
            while pages < len(child.blocks) and pos + page <= limit:
                if tuple(tokens[pos : pos + page]) != child.key[pages * page : (pages + 1) * page]:
                    break
                pages += 1
                pos += page
            path.append((child, pages))
            if pages < len(child.blocks):
                break
            node = child
        return path

    def split(self, node: Node, pages: int) -> Node:
        """Cuts `node` after `pages` pages; the rest becomes its only child. Returns that child."""
        cut = pages * self.page
        tail = Node(node.key[cut:], node.blocks[pages:], node)
        tail.children, tail.last_access = node.children, node.last_access
        for child in tail.children.values():
            child.parent = tail
        for block in tail.blocks:
            self.node_of_block[block] = tail
        node.key, node.blocks = node.key[:cut], node.blocks[:pages]
        node.children = {tail.key[: self.page]: tail}
        return tail

    def insert(self, parent: Node, key: tuple[int, ...], blocks: list[int]) -> Node:
        """A new child of `parent` (which has none starting with `key`'s first page)."""
        node = Node(key, list(blocks), parent)
        parent.children[key[: self.page]] = node
        for block in blocks:
            self.node_of_block[block] = node
        self.touch(node)
        return node

    def extend(self, node: Node, key: tuple[int, ...], blocks: list[int]) -> None:
        """Appends pages to a leaf's run."""
        node.key += key
        node.blocks += blocks
        for block in blocks:
            self.node_of_block[block] = node
        self.touch(node)

    def remove_leaf(self, node: Node) -> None:
        del node.parent.children[node.key[: self.page]]
        for block in node.blocks:
            del self.node_of_block[block]

    def touch(self, node: Node) -> None:
        """Marks `node` and its ancestors as just used."""
        self.clock += 1
        while node is not None and node is not self.root:
            node.last_access = self.clock
            node = node.parent

    def nodes(self) -> Iterator[Node]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def path_blocks(self, node: Node) -> list[int]:
        """The blocks from the root down to `node`, inclusive."""
        runs = []
        while node is not self.root:
            runs.append(node.blocks)
            node = node.parent
        return [b for run in reversed(runs) for b in run]
