//! The radix prefix cache: token-id keys mapped to the KV slots that hold them.
//!
//! Semantics follow SGLang's `RadixCache`: keys are page-aligned, a child is found by the first
//! page of its key, a partial match splits the node (the new parent inherits the lock count and
//! access time), every visited node's access time is refreshed, `insert` returns the length
//! already present, locks walk to the root moving lengths between `evictable` and `protected`,
//! and eviction pops least-recently-used unlocked leaves. Access "time" is a logical clock that
//! ticks once per visit, so LRU order is exact and the tree is deterministic.

use std::collections::BTreeSet;

use rustc_hash::FxHashMap;

use crate::pool::Slot;

/// Index of a node in the tree's arena.
pub type NodeId = u32;

/// The root: an empty key, never evicted, never locked.
pub const ROOT: NodeId = 0;

#[derive(Debug, Default)]
struct Node {
    parent: NodeId,
    /// Children keyed by the first page of their key.
    children: FxHashMap<Box<[u32]>, NodeId>,
    key: Vec<u32>,
    value: Vec<Slot>,
    lock_ref: u32,
    last_access: u64,
    alive: bool,
}

/// A radix tree over token ids whose values are KV slots.
#[derive(Debug)]
pub struct RadixTree {
    nodes: Vec<Node>,
    free_nodes: Vec<NodeId>,
    page_size: usize,
    disabled: bool,
    clock: u64,
    evictable_size: usize,
    protected_size: usize,
    /// Unlocked leaves other than the root, ordered by (last access, id): the eviction order.
    /// Kept up to date on every touch, lock change and leaf change, so eviction never walks
    /// the tree.
    evictable_leaves: BTreeSet<(u64, NodeId)>,
}

/// Length of the common prefix of `a` and `b`: whole blocks compared as slices (memcmp)
/// first, then the mismatching block element by element.
fn common_len(a: &[u32], b: &[u32]) -> usize {
    let n = a.len().min(b.len());
    let mut i = 0;
    for block in [128, 16] {
        while i + block <= n && a[i..i + block] == b[i..i + block] {
            i += block;
        }
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

impl RadixTree {
    /// An empty tree for keys in pages of `page_size` tokens. A disabled tree caches nothing:
    /// every match is empty and every insert reports the whole key as present, so callers
    /// free all of it.
    pub fn new(page_size: usize, disabled: bool) -> Self {
        assert!(page_size > 0, "page_size must be positive");
        let root = Node {
            alive: true,
            ..Node::default()
        };
        Self {
            nodes: vec![root],
            free_nodes: Vec::new(),
            page_size,
            disabled,
            clock: 0,
            evictable_size: 0,
            protected_size: 0,
            evictable_leaves: BTreeSet::new(),
        }
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Whether caching is disabled.
    pub fn is_disabled(&self) -> bool {
        self.disabled
    }

    /// Tokens held by unlocked nodes (reclaimable by [`evict`](Self::evict)).
    pub fn evictable_size(&self) -> usize {
        self.evictable_size
    }

    /// Tokens held by locked nodes.
    pub fn protected_size(&self) -> usize {
        self.protected_size
    }

    /// All tokens held by the tree.
    pub fn total_size(&self) -> usize {
        self.evictable_size + self.protected_size
    }

    /// Number of live nodes, root included.
    pub fn node_count(&self) -> usize {
        self.nodes.len() - self.free_nodes.len()
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn is_evictable_leaf(&self, id: NodeId) -> bool {
        let n = &self.nodes[id as usize];
        id != ROOT && n.alive && n.children.is_empty() && n.lock_ref == 0
    }

    /// Refreshes a node's access time, keeping the evictable-leaf order in step.
    fn touch(&mut self, id: NodeId) {
        let tick = self.tick();
        let leaf = self.is_evictable_leaf(id);
        let node = &mut self.nodes[id as usize];
        if leaf {
            self.evictable_leaves.remove(&(node.last_access, id));
            self.evictable_leaves.insert((tick, id));
        }
        node.last_access = tick;
    }

    fn new_node(&mut self, node: Node) -> NodeId {
        match self.free_nodes.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as NodeId
            }
        }
    }

    /// Splits `child` after its first `at` tokens; returns the new parent holding that head.
    fn split(&mut self, child: NodeId, at: usize) -> NodeId {
        let p = self.page_size;
        let c = &mut self.nodes[child as usize];
        let head_key: Vec<u32> = c.key.drain(..at).collect();
        let head_value: Vec<Slot> = c.value.drain(..at).collect();
        let (parent, lock_ref, last_access) = (c.parent, c.lock_ref, c.last_access);
        let tail_first: Box<[u32]> = c.key[..p].into();
        let head_first: Box<[u32]> = head_key[..p].into();
        let mut children = FxHashMap::default();
        children.insert(tail_first, child);
        let mid = self.new_node(Node {
            parent,
            children,
            key: head_key,
            value: head_value,
            lock_ref,
            last_access,
            alive: true,
        });
        self.nodes[child as usize].parent = mid;
        self.nodes[parent as usize].children.insert(head_first, mid);
        mid
    }

    /// Longest cached page-aligned prefix of `key`: appends its slots to `values` and returns
    /// its length and the deepest node on the path (lock it to keep the prefix from eviction).
    pub fn match_prefix(&mut self, key: &[u32], values: &mut Vec<Slot>) -> (usize, NodeId) {
        if self.disabled {
            return (0, ROOT);
        }
        let p = self.page_size;
        let key = &key[..key.len() / p * p];
        let mut node = ROOT;
        let mut matched = 0;
        while matched < key.len() {
            let Some(&child) = self.nodes[node as usize]
                .children
                .get(&key[matched..matched + p])
            else {
                break;
            };
            self.touch(child);
            let child_key = &self.nodes[child as usize].key;
            let n = common_len(child_key, &key[matched..]) / p * p;
            let whole = n == child_key.len();
            let next = if whole { child } else { self.split(child, n) };
            values.extend_from_slice(&self.nodes[next as usize].value);
            matched += n;
            node = next;
            if !whole {
                break;
            }
        }
        (matched, node)
    }

    /// Length of the longest cached page-aligned prefix of `key`, read without refreshing
    /// access times or splitting nodes: a question about the tree that leaves it as it was.
    pub fn cached_len(&self, key: &[u32]) -> usize {
        if self.disabled {
            return 0;
        }
        let p = self.page_size;
        let key = &key[..key.len() / p * p];
        let mut node = ROOT;
        let mut matched = 0;
        while matched < key.len() {
            let Some(&child) = self.nodes[node as usize]
                .children
                .get(&key[matched..matched + p])
            else {
                break;
            };
            let child_key = &self.nodes[child as usize].key;
            let n = common_len(child_key, &key[matched..]) / p * p;
            matched += n;
            if n < child_key.len() {
                break;
            }
            node = child;
        }
        matched
    }

    /// Inserts `key` (a whole number of pages) with its slots and returns how many leading
    /// tokens were already present. The caller owns `value[..returned]` still and must free
    /// those of them that it does not share with the tree (duplicates of cached entries).
    pub fn insert(&mut self, key: &[u32], value: &[Slot]) -> usize {
        assert_eq!(
            key.len(),
            value.len(),
            "radix insert: key and value lengths differ"
        );
        if self.disabled {
            return key.len();
        }
        let p = self.page_size;
        assert!(
            key.len().is_multiple_of(p),
            "radix insert: key length {} is not page-aligned",
            key.len()
        );
        let mut node = ROOT;
        let mut pos = 0;
        while pos < key.len() {
            let Some(&child) = self.nodes[node as usize].children.get(&key[pos..pos + p]) else {
                break;
            };
            self.touch(child);
            let child_key = &self.nodes[child as usize].key;
            let n = common_len(child_key, &key[pos..]) / p * p;
            node = if n == child_key.len() {
                child
            } else {
                self.split(child, n)
            };
            pos += n;
        }
        if pos < key.len() {
            let was_leaf = self.is_evictable_leaf(node);
            if was_leaf {
                let t = self.nodes[node as usize].last_access;
                self.evictable_leaves.remove(&(t, node));
            }
            let last_access = self.tick();
            let leaf = self.new_leaf(node, &key[pos..], &value[pos..], last_access);
            self.nodes[node as usize]
                .children
                .insert(key[pos..pos + p].into(), leaf);
            self.evictable_size += key.len() - pos;
            self.evictable_leaves.insert((last_access, leaf));
        }
        pos
    }

    /// Protects the path from `node` to the root from eviction.
    pub fn lock(&mut self, mut id: NodeId) {
        while id != ROOT {
            if self.is_evictable_leaf(id) {
                let t = self.nodes[id as usize].last_access;
                self.evictable_leaves.remove(&(t, id));
            }
            let n = &mut self.nodes[id as usize];
            if n.lock_ref == 0 {
                self.evictable_size -= n.key.len();
                self.protected_size += n.key.len();
            }
            n.lock_ref += 1;
            id = n.parent;
        }
    }

    /// Undoes one [`lock`](Self::lock) of `node`.
    pub fn unlock(&mut self, mut id: NodeId) {
        while id != ROOT {
            let n = &mut self.nodes[id as usize];
            assert!(n.lock_ref > 0, "radix unlock of an unlocked node {id}");
            n.lock_ref -= 1;
            if n.lock_ref == 0 {
                self.evictable_size += n.key.len();
                self.protected_size -= n.key.len();
            }
            let parent = n.parent;
            if self.is_evictable_leaf(id) {
                self.evictable_leaves
                    .insert((self.nodes[id as usize].last_access, id));
            }
            id = parent;
        }
    }

    /// Evicts least-recently-used unlocked leaves until at least `num_tokens` tokens are freed
    /// or nothing is evictable; appends the freed slots to `freed` and returns their count.
    pub fn evict(&mut self, num_tokens: usize, freed: &mut Vec<Slot>) -> usize {
        let p = self.page_size;
        let mut evicted = 0;
        while evicted < num_tokens {
            let Some((_, id)) = self.evictable_leaves.pop_first() else {
                break;
            };
            let node = &mut self.nodes[id as usize];
            evicted += node.value.len();
            freed.extend_from_slice(&node.value);
            self.evictable_size -= node.key.len();
            let parent = node.parent;
            let key = std::mem::take(&mut node.key);
            self.nodes[parent as usize].children.remove(&key[..p]);
            self.release(id, key);
            if self.is_evictable_leaf(parent) {
                self.evictable_leaves
                    .insert((self.nodes[parent as usize].last_access, parent));
            }
        }
        evicted
    }

    /// Returns an evicted leaf to the free list. Its key and value buffers are kept, empty,
    /// for the next leaf `insert` makes: under eviction pressure every request evicts and
    /// inserts about as much, and reusing them saves two allocations and frees per node.
    fn release(&mut self, id: NodeId, mut key: Vec<u32>) {
        let node = &mut self.nodes[id as usize];
        key.clear();
        node.key = key;
        node.value.clear();
        node.parent = ROOT;
        node.lock_ref = 0;
        node.alive = false;
        self.free_nodes.push(id);
    }

    /// A new unlocked leaf under `parent` holding `key` and `value` (reusing a released
    /// node's buffers when there is one).
    fn new_leaf(
        &mut self,
        parent: NodeId,
        key: &[u32],
        value: &[Slot],
        last_access: u64,
    ) -> NodeId {
        let Some(id) = self.free_nodes.pop() else {
            self.nodes.push(Node {
                parent,
                children: FxHashMap::default(),
                key: key.to_vec(),
                value: value.to_vec(),
                lock_ref: 0,
                last_access,
                alive: true,
            });
            return (self.nodes.len() - 1) as NodeId;
        };
        let node = &mut self.nodes[id as usize];
        debug_assert!(!node.alive && node.children.is_empty());
        node.key.extend_from_slice(key);
        node.value.extend_from_slice(value);
        node.parent = parent;
        node.last_access = last_access;
        node.alive = true;
        id
    }

    /// Drops every entry; returns the slots to free. Only valid when nothing is locked.
    pub fn reset(&mut self, freed: &mut Vec<Slot>) {
        assert_eq!(self.protected_size, 0, "radix reset while nodes are locked");
        for node in &self.nodes {
            if node.alive {
                freed.extend_from_slice(&node.value);
            }
        }
        *self = Self::new(self.page_size, self.disabled);
    }

    /// Parent of a node (the root is its own parent).
    pub fn parent(&self, id: NodeId) -> NodeId {
        self.nodes[id as usize].parent
    }

    /// Children of a node, in ascending id order (deterministic).
    pub fn children(&self, id: NodeId) -> Vec<NodeId> {
        let mut ids: Vec<NodeId> = self.nodes[id as usize].children.values().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Whether `id` names a live node.
    pub fn is_live(&self, id: NodeId) -> bool {
        self.nodes.get(id as usize).is_some_and(|n| n.alive)
    }

    /// Tokens in a node's key.
    pub fn node_len(&self, id: NodeId) -> usize {
        self.nodes[id as usize].key.len()
    }

    /// How many times a node is locked (directly or through a descendant).
    pub fn lock_ref(&self, id: NodeId) -> u32 {
        self.nodes[id as usize].lock_ref
    }

    /// Number of locked nodes (walks the arena; for checks).
    pub fn locked_nodes(&self) -> usize {
        self.nodes
            .iter()
            .filter(|n| n.alive && n.lock_ref > 0)
            .count()
    }

    /// Calls `f` with every node's slots (for pool ownership checks).
    pub fn for_each_value(&self, mut f: impl FnMut(&[Slot])) {
        self.nodes
            .iter()
            .filter(|n| n.alive)
            .for_each(|n| f(&n.value));
    }

    /// Every root-to-leaf path as its whole key and values (walks the tree; for tests).
    pub fn paths(&self) -> Vec<(Vec<u32>, Vec<Slot>)> {
        let mut out = Vec::new();
        let mut stack = vec![(ROOT, Vec::new(), Vec::new())];
        while let Some((id, mut key, mut value)) = stack.pop() {
            let node = &self.nodes[id as usize];
            key.extend_from_slice(&node.key);
            value.extend_from_slice(&node.value);
            let children = self.children(id);
            if children.is_empty() {
                if !key.is_empty() {
                    out.push((key, value));
                }
                continue;
            }
            for child in children {
                stack.push((child, key.clone(), value.clone()));
            }
        }
        out
    }

    /// Verifies the tree's structure and accounting; describes the first violation found.
    pub fn check(&self) -> Result<(), String> {
        let p = self.page_size;
        let (mut evictable, mut protected, mut reachable) = (0, 0, 0);
        let mut leaves = BTreeSet::new();
        let mut stack = vec![ROOT];
        while let Some(id) = stack.pop() {
            reachable += 1;
            let n = &self.nodes[id as usize];
            if !n.alive {
                return Err(format!("radix: dead node {id} is reachable"));
            }
            if id != ROOT {
                if n.key.is_empty()
                    || !n.key.len().is_multiple_of(p)
                    || n.key.len() != n.value.len()
                {
                    return Err(format!(
                        "radix: node {id} has key {} value {}",
                        n.key.len(),
                        n.value.len()
                    ));
                }
                if n.lock_ref == 0 {
                    evictable += n.key.len();
                } else {
                    protected += n.key.len();
                }
                if self.is_evictable_leaf(id) {
                    leaves.insert((n.last_access, id));
                }
            }
            for (first, &child) in &n.children {
                let c = &self.nodes[child as usize];
                if c.parent != id || c.key.get(..p) != Some(&first[..]) {
                    return Err(format!(
                        "radix: child {child} of {id} is linked inconsistently"
                    ));
                }
                if id != ROOT && c.lock_ref > n.lock_ref {
                    return Err(format!(
                        "radix: child {child} is locked more than its parent {id}"
                    ));
                }
                stack.push(child);
            }
        }
        if reachable != self.node_count() {
            return Err(format!(
                "radix: {} live nodes but {reachable} reachable",
                self.node_count()
            ));
        }
        if (evictable, protected) != (self.evictable_size, self.protected_size) {
            return Err(format!(
                "radix: counted evictable {evictable} protected {protected}, recorded {} {}",
                self.evictable_size, self.protected_size
            ));
        }
        if leaves != self.evictable_leaves {
            return Err("radix: evictable-leaf set is out of date".to_string());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(range: std::ops::Range<u32>) -> Vec<Slot> {
        range.collect()
    }

    fn matched(tree: &mut RadixTree, key: &[u32]) -> (usize, Vec<Slot>) {
        let mut v = Vec::new();
        let (n, _) = tree.match_prefix(key, &mut v);
        (n, v)
    }

    #[test]
    fn insert_reports_present_length_and_match_returns_slots() {
        let mut t = RadixTree::new(1, false);
        assert_eq!(t.insert(&[1, 2, 3, 4], &slots(10..14)), 0);
        assert_eq!(t.insert(&[1, 2, 3, 9, 9], &slots(20..25)), 3);
        assert_eq!(matched(&mut t, &[1, 2, 3, 9, 7]), (4, vec![10, 11, 12, 23]));
        assert_eq!(t.evictable_size(), 6);
        t.check().unwrap();
    }

    #[test]
    fn partial_match_splits_and_split_parent_inherits_lock() {
        let mut t = RadixTree::new(1, false);
        t.insert(&[1, 2, 3, 4], &slots(10..14));
        let mut v = Vec::new();
        let (_, leaf) = t.match_prefix(&[1, 2, 3, 4], &mut v);
        t.lock(leaf);
        assert_eq!(t.protected_size(), 4);
        let (n, mid) = t.match_prefix(&[1, 2, 7], &mut v);
        assert_eq!(n, 2);
        assert_eq!(t.node_count(), 3);
        assert_eq!(t.nodes[mid as usize].lock_ref, 1);
        t.check().unwrap();
        t.unlock(leaf);
        assert_eq!((t.evictable_size(), t.protected_size()), (4, 0));
        t.check().unwrap();
    }

    #[test]
    fn page_aligned_matching_floors_to_pages() {
        let mut t = RadixTree::new(4, false);
        t.insert(&[1, 2, 3, 4, 5, 6, 7, 8], &slots(4..12));
        assert_eq!(matched(&mut t, &[1, 2, 3, 4, 5, 6, 0, 0]).0, 4);
        assert_eq!(matched(&mut t, &[1, 2, 3, 4, 5, 6, 7]).0, 4);
        assert_eq!(matched(&mut t, &[1, 2, 3, 0]).0, 0);
        t.check().unwrap();
    }

    #[test]
    fn eviction_takes_oldest_leaves_and_then_their_parents() {
        let mut t = RadixTree::new(1, false);
        t.insert(&[1, 2, 3], &slots(1..4));
        t.insert(&[1, 2, 4], &slots(11..14));
        t.insert(&[5, 6], &slots(21..23));
        matched(&mut t, &[1, 2, 3]);
        let mut freed = Vec::new();
        // Leaves by last access: [4] (inserted), [5, 6] (inserted later), [3] (just matched).
        assert_eq!(t.evict(1, &mut freed), 1);
        assert_eq!(freed, vec![13]);
        freed.clear();
        assert_eq!(t.evict(2, &mut freed), 2);
        assert_eq!(freed, vec![21, 22]);
        freed.clear();
        // Now [3] goes, leaving [1, 2] as a leaf that is evicted next.
        assert_eq!(t.evict(3, &mut freed), 3);
        assert_eq!(freed, vec![3, 1, 2]);
        assert_eq!(t.total_size(), 0);
        t.check().unwrap();
    }

    #[test]
    fn locked_paths_are_not_evicted() {
        let mut t = RadixTree::new(1, false);
        t.insert(&[1, 2], &slots(1..3));
        t.insert(&[3, 4], &slots(3..5));
        let mut v = Vec::new();
        let (_, node) = t.match_prefix(&[1, 2], &mut v);
        t.lock(node);
        let mut freed = Vec::new();
        assert_eq!(t.evict(10, &mut freed), 2);
        assert_eq!(freed, vec![3, 4]);
        assert_eq!(t.protected_size(), 2);
        t.check().unwrap();
    }

    #[test]
    fn disabled_tree_matches_nothing_and_returns_everything() {
        let mut t = RadixTree::new(1, true);
        assert_eq!(t.insert(&[1, 2, 3], &slots(1..4)), 3);
        assert_eq!(matched(&mut t, &[1, 2, 3]).0, 0);
        assert_eq!(t.total_size(), 0);
    }
}
