//! The tensor-parallel loads ([`shard`](super::shard)'s planning) as methods of both kinds
//! of checkpoint: one `.safetensors` file, and a [`SafetensorsModel`] of several shards,
//! whose tensors are planned across every shard as if they were one file's.

use super::shard::{Listing, Replicas, Shard, ShardPlan};
use super::{Checkpoint, FileTensor, SafetensorsFile, SafetensorsModel, Tensor};
use crate::batch::BatchPlan;
use crate::error::Result;

/// Tensor-parallel loads, the same for one file and for a checkpoint of several shards.
macro_rules! tensor_parallel_loads {
    ($t:ty) => {
        impl $t {
            /// One batch per rank (`ranks` of them) that loads the tensors `rule` places, and
            /// where each shard lands in that rank's destination (`buffer_range`, with the
            /// shard's shape; `file_range` is the whole tensor's, in its own file). `rule`
            /// returns `None` for tensors no rank loads. A rule that does not fit a tensor (a
            /// dimension it lacks, or one that does not divide evenly, a rank out of range) is
            /// an [`Error::InvalidInput`](crate::Error::InvalidInput) naming the tensor. Every rank reads its replicated
            /// tensors itself ([`Replicas::ReadEach`]).
            pub fn plan_shards(
                &self,
                ranks: usize,
                rule: impl FnMut(&FileTensor) -> Option<Shard>,
            ) -> Result<Vec<(BatchPlan, Vec<Tensor>)>> {
                self.listing().plan_shards(ranks, rule)
            }

            /// As [`plan_shards`](Self::plan_shards), with every buffer laid out the same,
            /// except that each replicated tensor is read by one rank only
            /// ([`Replicas::ReadOnce`]): the copies that bring it to the other ranks come back
            /// alongside. Run them after the batches, on the receiving rank's stream.
            pub fn plan_shards_read_once(
                &self,
                ranks: usize,
                rule: impl FnMut(&FileTensor) -> Option<Shard>,
            ) -> Result<ShardPlan> {
                self.listing().plan_shards_read_once(ranks, rule)
            }

            /// Loads every rank's shards ([`plan_shards`](Self::plan_shards)) into a host
            /// buffer per rank, all ranks at once.
            pub async fn load_shards_host(
                &self,
                ranks: usize,
                rule: impl FnMut(&FileTensor) -> Option<Shard>,
            ) -> Result<Vec<Checkpoint<Vec<u8>>>> {
                self.listing().load_shards_host(ranks, rule).await
            }

            /// Loads rank `r`'s shards into one allocation on `streams[r]`'s device (a rank
            /// per stream: one GPU each, or several ranks on one GPU), all ranks at once. The
            /// copies are queued on each rank's stream, as `load_device` does. Replicated
            /// tensors are read once and copied between GPUs where they reach each other
            /// directly ([`Replicas::Auto`]).
            #[cfg(feature = "cuda")]
            pub async fn load_shards_device(
                &self,
                streams: &[std::sync::Arc<cudarc::driver::CudaStream>],
                rule: impl FnMut(&FileTensor) -> Option<Shard>,
            ) -> Result<Vec<Checkpoint<cudarc::driver::CudaSlice<u8>>>> {
                self.listing().load_shards_device(streams, rule).await
            }

            /// [`load_shards_device`](Self::load_shards_device), with the way replicated
            /// tensors reach every rank chosen by the caller.
            #[cfg(feature = "cuda")]
            pub async fn load_shards_device_with(
                &self,
                streams: &[std::sync::Arc<cudarc::driver::CudaStream>],
                rule: impl FnMut(&FileTensor) -> Option<Shard>,
                replicas: Replicas,
            ) -> Result<Vec<Checkpoint<cudarc::driver::CudaSlice<u8>>>> {
                self.listing()
                    .load_shards_device_with(streams, rule, replicas)
                    .await
            }
        }
    };
}

tensor_parallel_loads!(SafetensorsFile);
tensor_parallel_loads!(SafetensorsModel);

impl SafetensorsFile {
    pub(crate) fn listing(&self) -> Listing<'_> {
        Listing {
            entries: self.tensors.iter().map(|t| (&self.file, t)).collect(),
            path: self.file.path(),
            progress: self.progress.as_ref(),
        }
    }
}

impl SafetensorsModel {
    pub(crate) fn listing(&self) -> Listing<'_> {
        Listing {
            entries: self.tensors().map(|(s, t)| (s.file(), t)).collect(),
            path: self.path(),
            progress: self.progress.as_ref(),
        }
    }
}
