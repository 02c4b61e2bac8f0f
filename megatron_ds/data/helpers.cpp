// Index builders for GPT, BERT and T5 datasets (pybind11 module megatron_ds.data._helpers).
//
// All three functions are sequential scans that are slow in Python at the 10^9-token scale.
// megatron_ds/data/helpers.py holds NumPy versions with identical results; the tests prove it.
// The GIL is released while scanning so other Python threads (the index-cache heartbeat)
// keep running during a long build.

// The blending error w * i - n must be rounded twice (multiply, then subtract) exactly as
// Python/NumPy do, or a fused multiply-add can flip a near-tie and the two backends disagree.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// Walk the token stream formed by the documents of doc_idx, one sample of seq_length + 1 tokens
// at a time; consecutive samples share one token (the last input token is the next label).
// Row k of out holds (index into doc_idx, token offset in that document) where sample k starts.
template <typename DocT, typename OutT>
void fill_sample_idx(const int32_t* sizes, int64_t num_sizes, const DocT* doc_idx, int64_t num_docs,
                     int32_t seq_length, int64_t num_samples, OutT* out) {
    int64_t doc_pos = 0;     // index into doc_idx
    int64_t doc_offset = 0;  // first unused token of the current document
    out[0] = 0;
    out[1] = 0;
    for (int64_t sample = 1; sample <= num_samples; ++sample) {
        int64_t remaining = static_cast<int64_t>(seq_length) + 1;
        while (remaining != 0) {
            if (doc_pos >= num_docs) {
                throw std::invalid_argument(
                    "build_sample_idx: doc_idx holds fewer tokens than num_epochs * tokens_per_epoch");
            }
            const int64_t doc = static_cast<int64_t>(doc_idx[doc_pos]);
            if (doc < 0 || doc >= num_sizes) {
                throw std::out_of_range("build_sample_idx: doc_idx entry " + std::to_string(doc) +
                                        " is outside sizes (" + std::to_string(num_sizes) + " documents)");
            }
            const int64_t available = static_cast<int64_t>(sizes[doc]) - doc_offset;
            remaining -= available;
            if (remaining <= 0) {
                // The sample ends inside this document; its last token starts the next sample.
                doc_offset += remaining + available - 1;
                remaining = 0;
            } else {
                ++doc_pos;
                doc_offset = 0;
            }
        }
        out[2 * sample] = static_cast<OutT>(doc_pos);
        out[2 * sample + 1] = static_cast<OutT>(doc_offset);
    }
}

template <typename DocT>
py::array build_sample_idx_typed(const py::array_t<int32_t, py::array::c_style>& sizes,
                                 const py::array_t<DocT, py::array::c_style>& doc_idx, int32_t seq_length,
                                 int64_t num_epochs, int64_t tokens_per_epoch) {
    if (sizes.ndim() != 1 || doc_idx.ndim() != 1) {
        throw std::invalid_argument("build_sample_idx: sizes and doc_idx must be 1-D arrays");
    }
    if (seq_length < 1 || num_epochs < 1 || tokens_per_epoch < 1) {
        throw std::invalid_argument("build_sample_idx: seq_length, num_epochs and tokens_per_epoch must be >= 1");
    }
    const int64_t num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length;
    const int64_t num_docs = doc_idx.shape(0);
    const bool narrow = num_samples + 1 <= kInt32Max && num_docs <= kInt32Max;
    const int32_t* sizes_ptr = sizes.data();
    const DocT* doc_ptr = doc_idx.data();
    const int64_t num_sizes = sizes.shape(0);
    if (narrow) {
        py::array_t<int32_t> out({num_samples + 1, int64_t{2}});
        int32_t* out_ptr = out.mutable_data();
        {
            py::gil_scoped_release release;
            fill_sample_idx(sizes_ptr, num_sizes, doc_ptr, num_docs, seq_length, num_samples, out_ptr);
        }
        return std::move(out);
    }
    py::array_t<int64_t> out({num_samples + 1, int64_t{2}});
    int64_t* out_ptr = out.mutable_data();
    {
        py::gil_scoped_release release;
        fill_sample_idx(sizes_ptr, num_sizes, doc_ptr, num_docs, seq_length, num_samples, out_ptr);
    }
    return std::move(out);
}

// Dispatch on doc_idx's dtype so neither int32 nor int64 inputs are copied.
py::array build_sample_idx(const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& sizes,
                           const py::array& doc_idx, int32_t seq_length, int64_t num_epochs,
                           int64_t tokens_per_epoch) {
    if (py::isinstance<py::array_t<int32_t>>(doc_idx)) {
        return build_sample_idx_typed<int32_t>(sizes, py::array_t<int32_t, py::array::c_style>::ensure(doc_idx),
                                               seq_length, num_epochs, tokens_per_epoch);
    }
    auto as64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(doc_idx);
    if (!as64) {
        throw std::invalid_argument("build_sample_idx: doc_idx must be an integer array");
    }
    return build_sample_idx_typed<int64_t>(sizes, as64, seq_length, num_epochs, tokens_per_epoch);
}

// Greedy interleaving: sample i goes to the dataset furthest behind its target share
// weights[d] * i (the first one on ties), so every prefix of the blend tracks the weights.
template <typename IndexT>
void fill_blending(const double* weights, int64_t num_datasets, int64_t size, IndexT* dataset_index,
                   int64_t* dataset_sample_index) {
    std::vector<int64_t> taken(static_cast<size_t>(num_datasets), 0);
    for (int64_t i = 0; i < size; ++i) {
        const double position = i > 1 ? static_cast<double>(i) : 1.0;
        int64_t best = 0;
        double best_error = weights[0] * position - static_cast<double>(taken[0]);
        for (int64_t d = 1; d < num_datasets; ++d) {
            const double error = weights[d] * position - static_cast<double>(taken[d]);
            if (error > best_error) {
                best_error = error;
                best = d;
            }
        }
        dataset_index[i] = static_cast<IndexT>(best);
        dataset_sample_index[i] = taken[best];
        ++taken[best];
    }
}

py::tuple build_blending_indices(const py::array_t<double, py::array::c_style | py::array::forcecast>& weights,
                                 int64_t size) {
    if (weights.ndim() != 1 || weights.shape(0) < 1) {
        throw std::invalid_argument("build_blending_indices: weights must be a non-empty 1-D array");
    }
    if (size < 0) {
        throw std::invalid_argument("build_blending_indices: size must be >= 0");
    }
    const int64_t num_datasets = weights.shape(0);
    if (num_datasets > std::numeric_limits<int16_t>::max()) {
        throw std::invalid_argument("build_blending_indices: at most 32767 datasets can be blended");
    }
    const double* w = weights.data();
    py::array_t<int64_t> sample_index(size);
    int64_t* sample_ptr = sample_index.mutable_data();
    if (num_datasets <= 256) {
        py::array_t<uint8_t> dataset_index(size);
        uint8_t* index_ptr = dataset_index.mutable_data();
        {
            py::gil_scoped_release release;
            fill_blending(w, num_datasets, size, index_ptr, sample_ptr);
        }
        return py::make_tuple(dataset_index, sample_index);
    }
    py::array_t<int16_t> dataset_index(size);
    int16_t* index_ptr = dataset_index.mutable_data();
    {
        py::gil_scoped_release release;
        fill_blending(w, num_datasets, size, index_ptr, sample_ptr);
    }
    return py::make_tuple(dataset_index, sample_index);
}

// ---------------------------------------------------------------------------------------------
// BERT / T5 samples mapping: Megatron-DeepSpeed's megatron/data/helpers.cpp `build_mapping`
// (algorithm transcribed; the arrays it returns are identical for the same inputs and seed).
// A sample is a run of whole sentences of one document: rows (first sentence, one past the last
// sentence, target length). Documents with fewer than min_num_sent sentences, or with a sentence
// longer than kLongSentenceLen tokens, give no samples.

constexpr int32_t kLongSentenceLen = 512;

// Megatron's get_target_sample_len: with probability ~short_seq_prob a random length in
// [2, max_length], else max_length; one draw from the 32-bit Mersenne Twister per call.
inline int32_t target_sample_len(int32_t short_seq_ratio, int32_t max_length, std::mt19937& gen) {
    if (short_seq_ratio == 0) {
        return max_length;
    }
    const auto r = gen();
    if ((r % static_cast<uint32_t>(short_seq_ratio)) == 0) {
        return static_cast<int32_t>(2 + r % static_cast<uint32_t>(max_length - 1));
    }
    return max_length;
}

// One pass over the epochs; writes rows when out != nullptr, returns the number of samples.
// Both passes seed the generator alike, so they make the same decisions.
template <typename OutT>
uint64_t mapping_pass(const int64_t* docs, int64_t num_doc_bounds, const int32_t* sizes, int32_t num_epochs,
                      uint64_t max_num_samples, int32_t max_seq_length, int32_t short_seq_ratio, int32_t seed,
                      int32_t min_num_sent, OutT* out) {
    std::mt19937 gen(static_cast<uint32_t>(seed));
    uint64_t map_index = 0;
    for (int32_t epoch = 0; epoch < num_epochs; ++epoch) {
        // Megatron checks the sample count only between epochs: the last epoch is always whole.
        if (map_index >= max_num_samples) {
            break;
        }
        const uint64_t at_epoch_start = map_index;
        for (int64_t doc = 0; doc + 1 < num_doc_bounds; ++doc) {
            const int64_t first = docs[doc];
            const int64_t last = docs[doc + 1];
            int64_t remaining = last - first;
            bool long_sentence = false;
            if (remaining > 1) {
                for (int64_t s = first; s < last; ++s) {
                    if (sizes[s] > kLongSentenceLen) {
                        long_sentence = true;
                        break;
                    }
                }
            }
            if (remaining < min_num_sent || long_sentence) {
                continue;
            }
            int64_t start = first;
            int64_t seq_len = 0;
            int32_t num_sent = 0;
            int32_t target = target_sample_len(short_seq_ratio, max_seq_length, gen);
            for (int64_t s = first; s < last; ++s) {
                seq_len += sizes[s];
                ++num_sent;
                --remaining;
                // Close the sample at the target length unless that would leave a lone sentence,
                // and always at the end of the document.
                if ((seq_len >= target && remaining > 1 && num_sent >= min_num_sent) || remaining == 0) {
                    if (out != nullptr) {
                        out[3 * map_index] = static_cast<OutT>(start);
                        out[3 * map_index + 1] = static_cast<OutT>(s + 1);
                        out[3 * map_index + 2] = static_cast<OutT>(target);
                    }
                    ++map_index;
                    start = s + 1;
                    target = target_sample_len(short_seq_ratio, max_seq_length, gen);
                    seq_len = 0;
                    num_sent = 0;
                }
            }
        }
        if (map_index == at_epoch_start) {
            // Megatron would loop over ~2^31 empty epochs here; no document can give a sample.
            throw std::invalid_argument(
                "build_mapping: no document has enough sentences (each of at most 512 tokens) for a sample");
        }
    }
    return map_index;
}

template <typename OutT>
py::array build_mapping_typed(const int64_t* docs, int64_t num_doc_bounds, const int32_t* sizes,
                              int32_t num_epochs, uint64_t max_num_samples, int32_t max_seq_length,
                              int32_t short_seq_ratio, int32_t seed, int32_t min_num_sent) {
    uint64_t num_samples = 0;
    {
        py::gil_scoped_release release;
        num_samples = mapping_pass<OutT>(docs, num_doc_bounds, sizes, num_epochs, max_num_samples, max_seq_length,
                                         short_seq_ratio, seed, min_num_sent, nullptr);
    }
    py::array_t<OutT> out({static_cast<int64_t>(num_samples), int64_t{3}});
    OutT* rows = out.mutable_data();
    {
        py::gil_scoped_release release;
        mapping_pass<OutT>(docs, num_doc_bounds, sizes, num_epochs, max_num_samples, max_seq_length,
                           short_seq_ratio, seed, min_num_sent, rows);
        // Fisher-Yates with a 64-bit Mersenne Twister seeded seed + 1, as Megatron shuffles rows.
        std::mt19937_64 gen64(static_cast<uint64_t>(seed) + 1);
        for (int64_t i = static_cast<int64_t>(num_samples) - 1; i > 0; --i) {
            const auto j = static_cast<int64_t>(gen64() % static_cast<uint64_t>(i + 1));
            for (int k = 0; k < 3; ++k) {
                std::swap(rows[3 * i + k], rows[3 * j + k]);
            }
        }
    }
    return std::move(out);
}

py::array build_mapping(const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& docs,
                        const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& sizes,
                        int32_t num_epochs, uint64_t max_num_samples, int32_t max_seq_length,
                        double short_seq_prob, int32_t seed, int32_t min_num_sent) {
    if (docs.ndim() != 1 || sizes.ndim() != 1 || docs.shape(0) < 1) {
        throw std::invalid_argument("build_mapping: docs (document bounds) and sizes must be non-empty 1-D arrays");
    }
    if (num_epochs < 1 || max_seq_length < 2 || short_seq_prob < 0.0 || short_seq_prob > 1.0 || seed < 1 ||
        min_num_sent < 1) {
        throw std::invalid_argument(
            "build_mapping: needs num_epochs >= 1, max_seq_length >= 2, 0 <= short_seq_prob <= 1, seed >= 1, "
            "min_num_sent >= 1");
    }
    const int64_t* d = docs.data();
    const int64_t n = docs.shape(0);
    for (int64_t i = 0; i < n; ++i) {
        if (d[i] < 0 || d[i] > sizes.shape(0) || (i > 0 && d[i] < d[i - 1])) {
            throw std::out_of_range("build_mapping: docs must be non-decreasing sentence indices within sizes");
        }
    }
    // Megatron turns the probability into a ratio: a length is short when draw % ratio == 0.
    const int32_t ratio = short_seq_prob > 0 ? static_cast<int32_t>(std::round(1.0 / short_seq_prob)) : 0;
    if (sizes.shape(0) > static_cast<int64_t>(std::numeric_limits<uint32_t>::max())) {
        return build_mapping_typed<uint64_t>(d, n, sizes.data(), num_epochs, max_num_samples, max_seq_length, ratio,
                                             seed, min_num_sent);
    }
    return build_mapping_typed<uint32_t>(d, n, sizes.data(), num_epochs, max_num_samples, max_seq_length, ratio, seed,
                                         min_num_sent);
}

}  // namespace

PYBIND11_MODULE(_helpers, m) {
    m.doc() = "megatron_ds data index helpers: GPT sample index, BERT/T5 samples mapping and dataset blending";
    m.def("build_sample_idx", &build_sample_idx, py::arg("sizes"), py::arg("doc_idx"), py::arg("seq_length"),
          py::arg("num_epochs"), py::arg("tokens_per_epoch"),
          "[(num_epochs * tokens_per_epoch - 1) // seq_length + 1, 2] array of (doc_idx position, offset) "
          "where each sample of seq_length + 1 tokens starts; int32 when it fits, else int64.");
    m.def("build_blending_indices", &build_blending_indices, py::arg("weights"), py::arg("size"),
          "(dataset_index uint8 (int16 above 256 datasets), dataset_sample_index int64) for a greedy blend.");
    m.def("build_mapping", &build_mapping, py::arg("docs"), py::arg("sizes"), py::arg("num_epochs"),
          py::arg("max_num_samples"), py::arg("max_seq_length"), py::arg("short_seq_prob"), py::arg("seed"),
          py::arg("min_num_sent"),
          "[num_samples, 3] shuffled rows (first sentence, end sentence, target length) of BERT/T5 samples; "
          "uint32 unless sizes has more than 2^32 - 1 entries (then uint64). Megatron's build_mapping.");
}
