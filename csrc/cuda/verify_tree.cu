// verify_tree CUDA launcher (framework-free, see launch.h). No host sync, no allocation (the
// fallback kernel's residuals go to the workspace passed in): safe to capture in a CUDA graph.
//
// Launch configuration (static; kernels in csrc/kernels/verify_tree.cuh):
// * sm_90, a binary holding sm_90 code for the cluster kernel (verify_cluster_kernel_usable: an
//   8.0+PTX build JIT-compiled on an H100 runs its sm_80 body, a trap) and the cluster's slices
//   fit in shared memory: verify_tree_cluster_kernel, grid
//   B * cluster blocks of kVerifyThreads = 512 threads, clusters of `cluster` blocks (one per
//   sequence), dynamic shared memory 3 * ceil4(V / cluster) * 4 bytes. cluster = 16 (a
//   non-portable size Hopper allows) when 16-block clusters of that size can be resident and
//   the batch fits in one wave of them, else 8 (portable), else 16 if only that fits in shared
//   memory. E.g. V = 32000: 48 KB (8) / 24 KB (16); V = 128256: 192 KB (8) / 96 KB (16).
// * otherwise (sm_80, or V too large: over ~300k entries): verify_tree_block_kernel, one block of
//   512 threads per sequence.
// The choice depends only on the device, B and V (cached per device and size), never on data.
// The first call for a (device, B, V) queries the device (properties, occupancy, the kernel's
// shared-memory limit): make it before capturing a CUDA graph, as a warm-up call does; captured
// launches then only read the cache.
#include <map>
#include <mutex>
#include <tuple>

#include "kernels/verify_tree.cuh"
#include "launch.h"

namespace sequoia_kernels {

namespace {

struct ClusterPlan {
  int cluster = 0;  // 0: use the fallback kernel
  int64_t smem = 0;
};

int max_active_clusters(int cluster, int64_t smem, int64_t grid) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(kVerifyThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, verify_tree_cluster_kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();  // a failed query (not a sticky error): clear it, use another plan
    return 0;
  }
  return n;
}

// The plan for (device, B, V) in *out (cached; a failed device query is returned, not cached).
cudaError_t plan_cluster(int device, int64_t B, int64_t V, ClusterPlan* out) {
  static std::mutex mu;
  static std::map<std::tuple<int, int64_t, int64_t>, ClusterPlan> cache;
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(device, B, V);
  if (auto it = cache.find(key); it != cache.end()) {
    *out = it->second;
    return cudaSuccess;
  }
  ClusterPlan plan;
  cudaDeviceProp prop{};
  SK_CUDA_TRY(cudaGetDeviceProperties(&prop, device));
  cudaFuncAttributes fa{};
  SK_CUDA_TRY(cudaFuncGetAttributes(&fa, verify_tree_cluster_kernel));
  if (verify_cluster_kernel_usable(prop.major, fa.ptxVersion, fa.binaryVersion) && V <= (int64_t{1} << 30)) {
    const int64_t limit = static_cast<int64_t>(prop.sharedMemPerBlockOptin) - static_cast<int64_t>(fa.sharedSizeBytes);
    // The kernel's dynamic shared-memory limit is process-wide and only ever raised (to the
    // largest size probed or planned on this device): a launch of a cached plan on another
    // thread, outside this lock, never sees it lowered below what that plan needs.
    static std::map<int, int64_t> raised;
    int fit[2] = {0, 0};  // max active clusters of 8 and of 16
    const int sizes[2] = {8, 16};
    for (int k = 0; k < 2; ++k) {
      const int64_t smem = verify_cluster_smem_bytes(V, sizes[k]);
      if (smem > limit) continue;
      if (smem > raised[device]) {
        SK_CUDA_TRY(cudaFuncSetAttribute(verify_tree_cluster_kernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
        raised[device] = smem;
      }
      if (sizes[k] > 8)
        SK_CUDA_TRY(cudaFuncSetAttribute(verify_tree_cluster_kernel,
                                         cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
      fit[k] = max_active_clusters(sizes[k], smem, B * sizes[k]);
    }
    if (fit[1] >= 1 && (fit[1] >= B || fit[0] < 1)) plan.cluster = 16;
    else if (fit[0] >= 1) plan.cluster = 8;
    if (plan.cluster) plan.smem = verify_cluster_smem_bytes(V, plan.cluster);
  }
  cache[key] = plan;
  *out = plan;
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_verify_tree(const VerifyTreeParams& p, int device, cudaStream_t stream) {
  ClusterPlan plan;
  SK_CUDA_TRY(plan_cluster(device, p.B, p.V, &plan));
  if (plan.cluster == 0) {
    verify_tree_block_kernel<kVerifyThreads><<<static_cast<unsigned>(p.B), kVerifyThreads, 0, stream>>>(p);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(p.B * plan.cluster));
  cfg.blockDim = dim3(kVerifyThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(plan.smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = plan.cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, verify_tree_cluster_kernel, p);
}

}  // namespace sequoia_kernels
