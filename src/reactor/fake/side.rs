//! A fake lane beside the main one, for the reactor's tests of routing, lane-read failures,
//! fallbacks and death with side pieces out (what cuFile and SPDK do in the engine).

use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{FakeLane, FakeState};
use crate::lane::{Completion, Lane, LaneIo, Outcome, Route, RouteAsk, Routed};
use crate::target::Target;

/// The file a [`FakeSideLane`] takes (`Target::fake(SIDE_INO)`); any other goes to the main
/// lane.
pub(crate) const SIDE_INO: u64 = 77;
/// A completion result the side lane reads as its own failure ([`Outcome::Failed`]).
pub(crate) const SIDE_FAILED: i32 = -100_000;

/// A fake lane beside the main one, standing in for cuFile or SPDK: it takes the ops on
/// [`SIDE_INO`] (`Lane::route`), records their pieces like [`FakeLane`], reads
/// [`SIDE_FAILED`] as a failure of its own that asks for a fallback (or not, or that lost
/// the piece), and counts the fallbacks it was told to make.
pub(crate) struct FakeSideLane {
    pub(crate) state: Arc<Mutex<FakeState>>,
    pub(crate) fallback: bool,
    pub(crate) lost: bool,
    pub(crate) fell_back: Arc<std::sync::atomic::AtomicUsize>,
}

impl Lane for FakeSideLane {
    fn name(&self) -> &'static str {
        "fake-side"
    }

    // Pieces are recorded and completed as the main fake lane does.
    fn push(&mut self, io: LaneIo<'_>) -> io::Result<()> {
        FakeLane(self.state.clone()).push(io)
    }

    fn wait(
        &mut self,
        block: bool,
        timeout: Option<Duration>,
        out: &mut Vec<Completion>,
    ) -> io::Result<()> {
        FakeLane(self.state.clone()).wait(block, timeout, out)
    }

    fn outstanding(&self) -> usize {
        FakeLane(self.state.clone()).outstanding()
    }

    fn route(&mut self, ask: &RouteAsk<'_>) -> Routed {
        if ask.target.fence_key.ino != SIDE_INO {
            return Routed::No;
        }
        Routed::Take(Route {
            align: 1,
            chunk: ask.direct_chunk,
            backend: "fake-side",
            staging: None,
        })
    }

    fn classify(&self, res: i32, _target: &Target) -> Outcome {
        if res != SIDE_FAILED {
            return Outcome::Res(res);
        }
        Outcome::Failed {
            why: "the fake side lane turned the piece down".into(),
            fallback: self.fallback,
            lost: self.lost,
        }
    }

    fn fall_back(&self, _target: &Target, _why: String) {
        self.fell_back
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}
