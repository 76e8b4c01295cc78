#!/usr/bin/env bash
# Host facts that may explain why the profiler's device-step rate is bimodal across H200 hosts
# (about 40.5 or 46.5 GB/s at B24 4.2B's chunk layout, where training reaches 39-42 on every host):
# CPUs, NUMA nodes, and the NUMA node of the GPU's PCIe function. Prints to stdout.
lscpu 2>&1 | head -30
echo "== numactl"; numactl -H 2>&1 | head -20
echo "== nodes"; ls /sys/devices/system/node 2>&1
echo "== GPU PCIe functions (class 0x03xxxx) and their NUMA node"
for d in /sys/bus/pci/devices/*; do
  case "$(cat "$d/class" 2>/dev/null)" in 0x03*) echo "$d numa_node=$(cat "$d/numa_node" 2>/dev/null)";; esac
done
echo "== hugepages / THP"; cat /sys/kernel/mm/transparent_hugepage/enabled 2>&1
