// A caching allocator for torch's large CPU tensors (host_cache_install): blocks of 1 MiB and more that a step
// frees are kept and handed to the next step's tensors of the same size class, instead of going back to the OS.
//
// Why: PyTorch has no caching allocator on the CPU. Its default one asks the C library for each tensor, and glibc
// serves a block of tens of MiB (a 1024-token step of a 1B model: the gate|up output alone is 64 MiB) with its own
// mmap and returns it with munmap on free, so every step maps fresh pages and takes a page fault per 4 KiB on
// first write: ~0.3 us each on bare metal, 1.5-20 us on a cloud VM whose host takes freed guest memory back (a
// 1024-token prefill step of Llama-3.2-1B Q4_0 spent 1.2 of its 4.5 s faulting on a 2-CPU Zen 4 VM). PyTorch's
// CPU guides preload tcmalloc or jemalloc for this; glibc's own knobs (mallopt's mmap and trim thresholds) do
// not hold for the server's engine thread (an aligned block freed in a thread's arena goes back with its heap).
//
// Blocks are rounded up to one of 8 size classes per doubling (at most 12.5% over), so a step of 1000 tokens
// reuses the blocks of one of 1024; at most `limit` bytes of freed blocks are kept, the oldest freed first past it
// (a cache full of another workload's sizes must not turn the current one's blocks away), so the process holds
// about its recent steps' large activations beyond what is in use. Smaller requests go to the
// allocator that was installed before (glibc's bins already reuse small blocks). Thread-safe; installed once.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "ops.h"

namespace servescope_ops {
namespace {

constexpr size_t kMinBytes = size_t(1) << 20;
constexpr size_t kAlign = 64;  // c10's alloc_cpu alignment

size_t size_class(size_t n) {
  const int top = 63 - __builtin_clzll(n);
  const size_t step = size_t(1) << (top - 3);  // n >= 1 MiB: top >= 20
  return (n + step - 1) / step * step;
}

void release(void* p);

struct HostCache final : c10::Allocator {
  c10::Allocator* fallback = nullptr;  // small requests, and blocks it allocated before the install
  size_t limit = 0;
  std::mutex mu;
  std::unordered_map<void*, size_t> live;                // block -> its class size
  using Order = std::list<std::pair<size_t, void*>>;  // freed blocks kept, oldest first: (class size, block)
  Order order;
  std::unordered_map<size_t, std::deque<Order::iterator>> spare;  // class size -> its kept blocks, oldest first
  size_t cached = 0, in_use = 0, hits = 0, misses = 0, dropped = 0;

  // free the oldest kept blocks until `room` more bytes fit under the limit (the lock held); they are appended
  // to `out`, to be freed once the lock is released
  void evict(size_t room, std::vector<void*>& out) {
    while (!order.empty() && cached + room > limit) {
      auto [c, p] = order.front();
      auto& q = spare[c];
      q.pop_front();  // a class's blocks are in `order`'s order: its oldest is `order`'s front
      order.pop_front();
      cached -= c;
      out.push_back(p);
    }
  }

  c10::DataPtr allocate(size_t n) override {
    if (n < kMinBytes) return fallback->allocate(n);
    const size_t c = size_class(n);
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> g(mu);
      auto it = spare.find(c);
      if (it != spare.end() && !it->second.empty()) {  // the class's newest: the likeliest still in cache
        p = it->second.back()->second;
        order.erase(it->second.back());
        it->second.pop_back();
        cached -= c;
        ++hits;
        live.emplace(p, c);
        in_use += c;
      }
    }
    if (p == nullptr) {
      if (posix_memalign(&p, kAlign, c) != 0) p = nullptr;
      TORCH_CHECK_WITH(OutOfMemoryError, p != nullptr, "host_cache: could not allocate ", c, " bytes");
      std::lock_guard<std::mutex> g(mu);
      ++misses;
      live.emplace(p, c);
      in_use += c;
    }
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }

  // a block of ours goes back to its class, the oldest kept ones to the OS if it needs their room (a block larger
  // than the limit goes to the OS itself); any other pointer to `fallback`
  void put(void* p) {
    std::vector<void*> out;
    bool ours = false;
    {
      std::lock_guard<std::mutex> g(mu);
      auto it = live.find(p);
      if (it != live.end()) {
        ours = true;
        const size_t c = it->second;
        live.erase(it);
        in_use -= c;
        if (c <= limit) {
          evict(c, out);
          spare[c].push_back(order.insert(order.end(), {c, p}));
          cached += c;
        } else {
          out.push_back(p);
        }
        dropped += out.size();
      }
    }
    for (void* q : out) std::free(q);
    if (!ours) fallback->raw_deleter()(p);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

HostCache* cache() {
  static HostCache* c = new HostCache();  // never destroyed: tensors may be freed during interpreter teardown
  return c;
}

void release(void* p) { cache()->put(p); }

std::once_flag installed;

}  // namespace

void host_cache_install(int64_t limit_bytes) {
  TORCH_CHECK(limit_bytes >= 0, "host_cache_install: a limit of at least 0 bytes");
  std::call_once(installed, [&] {
    HostCache* c = cache();
    c->fallback = c10::GetCPUAllocator();  // (its limit is set below, as on every later call)
    c10::SetCPUAllocator(c, /*priority=*/1);
  });
  HostCache* c = cache();
  std::vector<void*> out;  // kept blocks past a lowered limit go back to the OS, the oldest first
  {
    std::lock_guard<std::mutex> g(c->mu);
    c->limit = size_t(limit_bytes);
    c->evict(0, out);
    c->dropped += out.size();
  }
  for (void* p : out) std::free(p);
}

std::map<std::string, int64_t> host_cache_stats() {
  HostCache* c = cache();
  std::lock_guard<std::mutex> g(c->mu);
  return {{"installed", c->fallback != nullptr && c10::GetCPUAllocator() == c},
          {"limit_bytes", int64_t(c->limit)},   {"cached_bytes", int64_t(c->cached)},
          {"in_use_bytes", int64_t(c->in_use)}, {"hits", int64_t(c->hits)},
          {"misses", int64_t(c->misses)},       {"dropped", int64_t(c->dropped)}};
}

}  // namespace servescope_ops
