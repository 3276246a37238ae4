//! One service's endpoints merged across the registry files that list
//! them, kept between changes: a change to one file re-merges that file's
//! listings — and those of another file only where one of them lists an
//! address the other lists too — never the service's other files.
//!
//! The rule is the file registry's: files in path order, each file's
//! listings in document order, and an address listed again for a port an
//! earlier listing of it serves is ignored. Every listing of an address is
//! kept in that order, so which listing stands is decided per address.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tether_core::registry::EndpointSpec;

#[derive(Default)]
pub(super) struct EndpointMerge {
    /// The files merged, in path order.
    parts: BTreeMap<PathBuf, Part>,
    /// Each part's path by its id (listings name files by id).
    paths: HashMap<u32, PathBuf>,
    next_id: u32,
    /// Every listing of each address, in merge order: the first inline,
    /// so a service whose addresses are listed once allocates nothing per
    /// address.
    listings: HashMap<SocketAddr, Listings>,
    /// How many times a file's listings were read, for tests of what a
    /// change costs.
    #[cfg(test)]
    pub(super) files_read: usize,
}

/// One file's share of the service.
struct Part {
    id: u32,
    /// The version of the file's documents it was merged from.
    generation: u64,
    /// Address and port of every listing, in the file's order.
    listed: Vec<(SocketAddr, Option<u16>)>,
    /// The listings that stand, shared with the service states served.
    kept: Arc<[EndpointSpec]>,
    /// How many listings an earlier one overrides.
    dropped: usize,
}

#[derive(Clone, Copy, Debug)]
struct Listing {
    file: u32,
    seq: u32,
    port: Option<u16>,
    kept: bool,
}

struct Listings {
    first: Listing,
    more: Vec<Listing>,
}

impl Listings {
    fn iter(&self) -> impl Iterator<Item = &Listing> {
        std::iter::once(&self.first).chain(&self.more)
    }

    fn find(&self, file: u32, seq: u32) -> Option<&Listing> {
        self.iter().find(|l| l.file == file && l.seq == seq)
    }

    /// Removes one listing; returns whether none is left.
    fn remove(&mut self, file: u32, seq: u32) -> bool {
        if self.first.file == file && self.first.seq == seq {
            if self.more.is_empty() {
                return true;
            }
            self.first = self.more.remove(0);
        } else {
            self.more.retain(|l| !(l.file == file && l.seq == seq));
        }
        false
    }

    /// Decides again which listings stand, in order: each unless a kept
    /// earlier one serves a port it serves. Returns the files whose
    /// listings changed their standing.
    fn settle(&mut self, changed: &mut Vec<u32>) {
        let mut kept: Vec<Option<u16>> = Vec::new();
        for l in std::iter::once(&mut self.first).chain(&mut self.more) {
            let stands = !kept.iter().any(|&p| serves_overlap(p, l.port));
            if stands {
                kept.push(l.port);
            }
            if l.kept != stands {
                l.kept = stands;
                changed.push(l.file);
            }
        }
    }
}

fn serves_overlap(a: Option<u16>, b: Option<u16>) -> bool {
    a.is_none() || b.is_none() || a == b
}

impl EndpointMerge {
    /// Brings the merge up to `files` (path order, each with the version
    /// of its documents), reading the listings of a file whose version
    /// changed with `listings_of`. Returns the parts to serve, in order.
    pub(super) fn sync<'a>(
        &mut self,
        files: &[(&Path, u64)],
        listings_of: impl Fn(&Path) -> Vec<&'a EndpointSpec>,
    ) -> Vec<Arc<[EndpointSpec]>> {
        let mut affected: Vec<SocketAddr> = Vec::new();
        // The listings just read, by file, for building its part.
        let mut fresh: HashMap<u32, Vec<&'a EndpointSpec>> = HashMap::new();
        let mut rebuild: BTreeSet<u32> = BTreeSet::new();
        let wanted: BTreeSet<&Path> = files.iter().map(|(p, _)| *p).collect();
        let gone: Vec<PathBuf> = self
            .parts
            .keys()
            .filter(|p| !wanted.contains(p.as_path()))
            .cloned()
            .collect();
        for path in gone {
            if let Some(part) = self.parts.remove(&path) {
                self.unlist(&part, &mut affected);
                self.paths.remove(&part.id);
            }
        }
        for &(path, generation) in files {
            if self.parts.get(path).map(|p| p.generation) == Some(generation) {
                continue;
            }
            let listings = listings_of(path);
            #[cfg(test)]
            {
                self.files_read += 1;
            }
            let id = match self.parts.get_mut(path) {
                Some(part) => {
                    let old = std::mem::take(&mut part.listed);
                    let id = part.id;
                    self.unlist_all(id, &old, &mut affected);
                    id
                }
                None => {
                    let id = self.next_id;
                    self.next_id += 1;
                    self.paths.insert(id, path.to_path_buf());
                    self.parts.insert(
                        path.to_path_buf(),
                        Part {
                            id,
                            generation,
                            listed: Vec::new(),
                            kept: Arc::new([]),
                            dropped: 0,
                        },
                    );
                    id
                }
            };
            let listed: Vec<(SocketAddr, Option<u16>)> =
                listings.iter().map(|ep| (ep.address, ep.port)).collect();
            for (seq, &(address, port)) in listed.iter().enumerate() {
                self.list(id, seq as u32, address, port);
                affected.push(address);
            }
            let part = self.parts.get_mut(path).expect("inserted above");
            part.listed = listed;
            part.generation = generation;
            rebuild.insert(id);
            fresh.insert(id, listings);
        }
        affected.sort_unstable();
        affected.dedup();
        let mut changed = Vec::new();
        for address in affected {
            if let Some(listings) = self.listings.get_mut(&address) {
                listings.settle(&mut changed);
            }
        }
        rebuild.extend(changed);
        for id in rebuild {
            let Some(path) = self.paths.get(&id).cloned() else {
                continue;
            };
            let listings = fresh.remove(&id).unwrap_or_else(|| {
                #[cfg(test)]
                {
                    self.files_read += 1;
                }
                listings_of(&path)
            });
            let part = self.parts.get_mut(&path).expect("a part per id");
            let mut kept = Vec::with_capacity(listings.len());
            let mut dropped = 0;
            for (seq, ep) in listings.into_iter().enumerate() {
                let stands = self
                    .listings
                    .get(&ep.address)
                    .and_then(|l| l.find(id, seq as u32))
                    .is_some_and(|l| l.kept);
                if stands {
                    kept.push(ep.clone());
                } else {
                    dropped += 1;
                }
            }
            part.kept = kept.into();
            part.dropped = dropped;
        }
        self.parts
            .values()
            .filter(|p| !p.kept.is_empty())
            .map(|p| p.kept.clone())
            .collect()
    }

    fn unlist(&mut self, part: &Part, affected: &mut Vec<SocketAddr>) {
        self.unlist_all(part.id, &part.listed, affected);
    }

    fn unlist_all(
        &mut self,
        id: u32,
        listed: &[(SocketAddr, Option<u16>)],
        affected: &mut Vec<SocketAddr>,
    ) {
        for (seq, (address, _)) in listed.iter().enumerate() {
            if let Some(listings) = self.listings.get_mut(address) {
                if listings.remove(id, seq as u32) {
                    self.listings.remove(address);
                }
            }
            affected.push(*address);
        }
    }

    /// Adds a listing at its place in merge order (path, then position).
    fn list(&mut self, file: u32, seq: u32, address: SocketAddr, port: Option<u16>) {
        let listing = Listing {
            file,
            seq,
            port,
            kept: true,
        };
        let listings = match self.listings.entry(address) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(Listings {
                    first: listing,
                    more: Vec::new(),
                });
                return;
            }
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
        };
        let paths = &self.paths;
        let order = |l: &Listing| (&paths[&l.file], l.seq);
        let key = order(&listing);
        if key < order(&listings.first) {
            let first = std::mem::replace(&mut listings.first, listing);
            listings.more.insert(0, first);
            return;
        }
        let at = listings.more.partition_point(|l| order(l) < key);
        listings.more.insert(at, listing);
    }

    /// How many listings an earlier one overrides, in every file.
    pub(super) fn duplicates(&self) -> usize {
        self.parts.values().map(|p| p.dropped).sum()
    }

    /// The first overridden listing in merge order: its address, the file
    /// of the listing kept, and its own file.
    pub(super) fn first_duplicate(&self) -> Option<(SocketAddr, PathBuf, PathBuf)> {
        let (path, part) = self.parts.iter().find(|(_, p)| p.dropped > 0)?;
        part.listed
            .iter()
            .enumerate()
            .find_map(|(seq, &(address, port))| {
                let listings = self.listings.get(&address)?;
                if listings.find(part.id, seq as u32)?.kept {
                    return None;
                }
                let kept = listings
                    .iter()
                    .find(|l| l.kept && serves_overlap(l.port, port))?;
                Some((address, self.paths[&kept.file].clone(), path.clone()))
            })
    }
}
